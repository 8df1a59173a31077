"""The seal on each diff and on the release table: a first line holding the sha256 of the
rest, so that a copy cut short (at a hunk boundary it still parses) or damaged is refused."""
HEADER = "# sha256 of the lines below: "
UNSEALED, DAMAGED = "unsealed", "damaged"


def sha256_hex(data: bytes) -> str:
    # CPython's own sha256: hashlib would load OpenSSL first, which alone costs a
    # tenth of a --check run.
    try:
        from _sha2 import sha256  # Python 3.12+
    except ImportError:
        try:
            from _sha256 import sha256
        except ImportError:
            from hashlib import sha256
    return sha256(data).hexdigest()


def seal(body: str) -> str:
    return f"{HEADER}{sha256_hex(body.encode('utf-8'))}\n{body}"


def unsealed(text: str) -> "tuple[str | None, str | None]":
    """(the text below the seal, None) if it is whole; else (None, UNSEALED or DAMAGED)."""
    first, _, body = text.partition("\n")
    if not first.startswith(HEADER):
        return None, UNSEALED
    if sha256_hex(body.encode("utf-8")) != first[len(HEADER):].strip():
        return None, DAMAGED
    return body, None
