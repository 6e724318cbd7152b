"""PEP 517 build backend of the tensorfs client, standard library only.

pip builds a wheel with nothing to download: the package is pure Python
(tensorfs/*.py and the dtype table tensorfs/dtypes.json). NumPy is the one
requirement; torch is optional (the "torch" extra).
"""

import base64
import hashlib
import io
import os
import tarfile
import zipfile

NAME = "tensorfs"
VERSION = "0.2.0"
SUMMARY = "Client of tensorfs, a FUSE filesystem of shared-memory tensors"
REQUIRES_PYTHON = ">=3.9"
REQUIRES = ["numpy"]
EXTRAS = {"torch": ["torch>=1.13"]}

HERE = os.path.dirname(os.path.abspath(__file__))
DIST_INFO = "%s-%s.dist-info" % (NAME, VERSION)


def _metadata():
    lines = ["Metadata-Version: 2.1", "Name: " + NAME, "Version: " + VERSION,
             "Summary: " + SUMMARY, "Requires-Python: " + REQUIRES_PYTHON]
    lines += ["Requires-Dist: " + r for r in REQUIRES]
    for extra, reqs in EXTRAS.items():
        lines.append("Provides-Extra: " + extra)
        lines += ['Requires-Dist: %s; extra == "%s"' % (r, extra) for r in reqs]
    return "\n".join(lines) + "\n"


def _package_files():
    """Yield (path in the archive, path on disk) of the package's files."""
    pkg = os.path.join(HERE, NAME)
    for name in sorted(os.listdir(pkg)):
        if name.endswith((".py", ".json")) or name == "py.typed":
            yield NAME + "/" + name, os.path.join(pkg, name)


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (arcname, digest, len(data))


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    d = os.path.join(metadata_directory, DIST_INFO)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(_metadata())
    return DIST_INFO


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = "%s-%s-py3-none-any.whl" % (NAME, VERSION)
    records = []
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        def add(arcname, data):
            z.writestr(arcname, data)
            records.append(_record_line(arcname, data))
        for arcname, path in _package_files():
            with open(path, "rb") as f:
                add(arcname, f.read())
        add(DIST_INFO + "/METADATA", _metadata().encode())
        add(DIST_INFO + "/WHEEL", b"Wheel-Version: 1.0\nGenerator: tensorfs _build\n"
            b"Root-Is-Purelib: true\nTag: py3-none-any\n")
        records.append(DIST_INFO + "/RECORD,,")
        z.writestr(DIST_INFO + "/RECORD", "\n".join(records) + "\n")
    return name


def build_sdist(sdist_directory, config_settings=None):
    base = "%s-%s" % (NAME, VERSION)
    name = base + ".tar.gz"
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz") as t:
        files = [(n, os.path.join(HERE, n)) for n in ("pyproject.toml", "_build.py")]
        for arcname, path in files + list(_package_files()):
            t.add(path, base + "/" + arcname)
        info = tarfile.TarInfo(base + "/PKG-INFO")
        data = _metadata().encode()
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    return name
