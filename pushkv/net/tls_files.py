"""TLS files that change on disk: the newest consistent set, re-read when a
file's stat changes.

cert-manager renews a certificate in place (its CSI driver swaps the mounted
files at once, as Kubernetes' atomic writer does; other tools may write them
one by one). `FileWatch.current` stats the three files at every call (a few
microseconds) and re-reads them only when a stat changed. A set that does not
hold together (a certificate and a key that do not match, a file half
written or missing) is not taken: the previous one stays in use and the files
are read again at the next call, so a renewal written file by file is taken
once its last file is in place.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

log = logging.getLogger("pushkv.tls")

Stamp = tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True, slots=True)
class Material:
    """One consistent set of PEM bytes, and which set it is: `version` counts
    the sets taken in this process (1 for the first)."""

    ca: bytes
    cert: bytes
    key: bytes
    version: int
    serial: int  # this side's certificate's
    not_after: dt.datetime


def _stamp(paths: tuple[str, str, str]) -> Stamp:
    # os.stat follows the links an atomic writer swaps (tls.crt -> ..data/tls.crt).
    out = []
    for p in paths:
        s = os.stat(p)
        out.append((s.st_dev, s.st_ino, s.st_mtime_ns, s.st_size))
    return tuple(out)


def _public(key: object) -> bytes:
    return key.public_bytes(  # type: ignore[attr-defined, no-any-return]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def parse(ca: bytes, cert: bytes, key: bytes) -> x509.Certificate:
    """This side's certificate, once the three hold together; ValueError naming
    what does not."""
    try:
        x509.load_pem_x509_certificates(ca)
    except ValueError as exc:
        raise ValueError(f"the CA file holds no PEM certificate ({exc})") from None
    try:
        leaf = x509.load_pem_x509_certificates(cert)[0]
    except ValueError as exc:
        raise ValueError(f"the certificate file holds no PEM certificate ({exc})") from None
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the key file holds no unencrypted PEM private key ({exc})") from None
    if _public(leaf.public_key()) != _public(private.public_key()):
        raise ValueError("the key does not belong to the certificate")
    return leaf


class FileWatch:
    """The newest consistent material of three PEM files (CA, certificate, key)."""

    def __init__(self, ca: str, cert: str, key: str) -> None:
        self._paths = (ca, cert, key)
        self._lock = threading.Lock()
        self._stamp: Stamp | None = None
        self._material: Material | None = None
        self._refused: Stamp | str | None = None  # the last refused (logged once each)
        self.refused = 0  # sets read and not taken (inconsistent, half written)

    @property
    def taken(self) -> bool:
        """Whether a consistent set was ever read."""
        return self._material is not None

    def current(self) -> Material:
        """The newest consistent set; ValueError if none was ever read."""
        try:
            stamp = _stamp(self._paths)
        except OSError as exc:
            return self._keep(None, f"cannot stat it: {exc}")
        material = self._material
        if material is not None and stamp == self._stamp:
            return material
        with self._lock:
            return self._read(stamp)

    def _read(self, stamp: Stamp) -> Material:
        old = self._material
        if old is not None and stamp == self._stamp:
            return old  # another thread read it meanwhile
        try:
            ca, cert, key = (Path(p).read_bytes() for p in self._paths)
        except OSError as exc:
            return self._keep(stamp, f"cannot read it: {exc}")
        if old is not None and (ca, cert, key) == (old.ca, old.cert, old.key):
            self._stamp = stamp  # touched, not changed
            return old
        try:
            leaf = parse(ca, cert, key)
        except ValueError as exc:
            return self._keep(stamp, str(exc))
        new = Material(
            ca,
            cert,
            key,
            version=(old.version + 1) if old else 1,
            serial=leaf.serial_number,
            not_after=leaf.not_valid_after_utc,
        )
        self._material, self._stamp = new, stamp
        if old is not None:
            log.info(
                "TLS files %s changed: certificate serial %x (was %x), valid until %s; "
                "new connections use it",
                self._paths[1],
                new.serial,
                old.serial,
                new.not_after.isoformat(),
            )
        return new

    def _keep(self, stamp: Stamp | None, why: str) -> Material:
        """The files cannot be taken now: the previous set, or ValueError if none."""
        old = self._material
        if old is None:
            ca, cert, key = self._paths
            raise ValueError(f"TLS files (ca {ca!r}, cert {cert!r}, key {key!r}): {why}")
        self.refused += 1
        seen = why if stamp is None else stamp  # a file gone: its error tells it apart
        if seen != self._refused:
            self._refused = seen
            log.warning(
                "TLS files %s are not a usable set now (%s): new connections keep "
                "certificate serial %x until they are",
                self._paths[1],
                why,
                old.serial,
            )
        return old


_WATCHES: dict[tuple[str, str, str], FileWatch] = {}
_WATCHES_LOCK = threading.Lock()


def watch(ca: str, cert: str, key: str) -> FileWatch:
    """The process's one watch of these files (every channel and server of
    the process that names them shares it)."""
    paths = (ca, cert, key)
    found = _WATCHES.get(paths)
    if found is None:
        with _WATCHES_LOCK:
            found = _WATCHES.setdefault(paths, FileWatch(*paths))
    return found
