package fs

import (
	"syscall"

	"tensorfs/ledger"
)

// newBudget is a row of a ledger of its own, refused as the descriptors'
// row is, for tests that bound one thing.
func newBudget(what string, perUID, total int) *ledger.Row {
	return ledger.New().Row(ledger.Spec{Name: what, Unit: "one", PerUID: int64(perUID), Total: int64(total),
		Over: syscall.EMFILE, Full: syscall.ENFILE})
}
