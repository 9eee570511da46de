"""A file that proves its integrity: one header line with the payload's length and SHA-256, then
the payload.

``torch.load`` does not notice flipped bytes inside a tensor, nor every truncation: a checkpoint
damaged on disk or in a copy would resume into a different run. A sealed file is checked before
anything reads its payload, so a damaged, truncated or hand-edited file is refused whole.
"""

from __future__ import annotations

import hashlib

__all__ = ["MAGIC", "SealError", "seal", "unseal"]

MAGIC = b"gradaccum-sealed-v1"


class SealError(ValueError):
    """The bytes are not a sealed file, or not the ones that were sealed.

    Example:
        >>> isinstance(SealError("damaged"), ValueError)
        True
    """


def seal(payload: bytes) -> bytes:
    """``payload`` behind a header naming its length and SHA-256.

    Args:
        payload: the bytes to protect.

    Returns:
        The header line followed by ``payload``.

    Example:
        >>> seal(b"abc")[:20]
        b'gradaccum-sealed-v1 '
    """
    digest = hashlib.sha256(payload).hexdigest()
    return b"%s %d %s\n" % (MAGIC, len(payload), digest.encode()) + payload


def unseal(data: bytes) -> bytes:
    """The payload of a sealed file, once its length and SHA-256 are checked.

    Args:
        data: the file's bytes.

    Returns:
        The payload.

    Raises:
        SealError: no header (not a sealed file), fewer or more bytes than the header names
            (truncated or appended to), or a SHA-256 that does not match (damaged or edited).

    Example:
        >>> unseal(seal(b"abc"))
        b'abc'
        >>> try:
        ...     unseal(seal(b"abc")[:-1])
        ... except SealError as err:
        ...     print(err)
        truncated: 2 of its 3 bytes are there
    """
    header, newline, payload = data.partition(b"\n")
    parts = header.split(b" ")
    if not newline or len(parts) != 3 or parts[0] != MAGIC or not parts[1].isdigit():
        raise SealError("not a sealed gradaccum file (no integrity header)")
    size, digest = int(parts[1]), parts[2].decode("ascii", "replace")
    if len(payload) < size:
        raise SealError(f"truncated: {len(payload)} of its {size} bytes are there")
    if len(payload) > size:
        raise SealError(f"{len(payload) - size} bytes were added after its {size} bytes")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise SealError("damaged or edited: its SHA-256 does not match the one it was written with")
    return payload
