"""A frontier row's request packed: fewer bytes a pending request.

A request is stored as the codec's JSON text (:mod:`scrapy_idempotent.codec`; on PostgreSQL
without its URL, :func:`.rules.stored_request_data`). Most of that text is the same from row
to row (member names, ``"headers":{"Referer":["https://``, ``"meta":{"depth":``) or repeats
the row's own URL (a ``Referer`` is most often a page of the same site). :func:`pack` stores
it as raw deflate (no zlib header nor checksum) with a preset dictionary of those fixed
fragments followed by the row's URL: the 113 bytes of a link with a ``Referer`` and a depth
become about 50.

The packed form (``bytes``)::

    format (1 byte) | check (2 bytes) | raw deflate of the text (UTF-8)

* ``format``: which dictionary (:data:`DICTIONARIES`). A released dictionary never changes:
  another one gets the next format byte, and every earlier one stays here, for the rows
  written with it. A format byte is below 0x20, so never the first byte of a stored text
  (``{`` or a space).
* ``check``: the low 16 bits of the CRC-32 of the text, big-endian: a wrong dictionary (or a
  row's URL changed without its request) gives back other text, and the check refuses it
  (all but 1 in 65,536 such rows; a truncated stream is refused by inflate itself) instead of
  handing out garbage.

:func:`pack` gives None where the packed form would not be smaller than the text: that row
keeps the text, as every row did before. :func:`unpack` gives back exactly the text packed.
"""

from __future__ import annotations

import zlib

from ..exceptions import StoreError

__all__ = ["DICTIONARIES", "FORMAT", "PackedRequestError", "pack", "unpack"]


class PackedRequestError(StoreError):
    """A stored request whose packed form cannot be read back (unknown format, truncated,
    or not the text it was packed from): a damaged row, reported as any store error is (the
    commands print it; a crawl's claim that meets it fails, nothing of it committed)."""


#: The fixed part of each format's dictionary (the row's URL, UTF-8, follows it). Deflate
#: codes a match nearer the end of the dictionary in fewer bits: the most frequent fragments
#: come last. NEVER CHANGE A RELEASED ENTRY.
DICTIONARIES: dict[int, bytes] = {
    1: (
        b'"_class":"scrapy.http.request.json_request.JsonRequest"'
        b'"_class":"scrapy.http.request.form.FormRequest"'
        b'"dumps_kwargs":{"sort_keys":true},'
        b'"cookies":{},"encoding":"utf-8","flags":[],"cb_kwargs":{},"dont_filter":false,'
        b'"method":"POST","priority":0,"errback":null,"body":{"$bytes":"'
        b'"Content-Type":["application/x-www-form-urlencoded"],'
        b'"Content-Type":["application/json"],'
        b'"Accept":["application/json, text/javascript, */*; q=0.01"],'
        b'"Accept":["text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"],'
        b'"Accept-Language":["en"],"User-Agent":["Mozilla/5.0 (Windows NT 10.0; Win64; x64)'
        b' AppleWebKit/537.36 (KHTML, like Gecko) Chrome/'
        b'"Cookie":["'
        b'"redirect_times":1,"redirect_ttl":19,"redirect_urls":["https://'
        b'"redirect_reasons":[301],"retry_times":1,"download_slot":"'
        b'"dont_filter":true,"priority":1}'
        b'"errback":"'
        b'"callback":"parse_item","meta":{"depth":1}}'
        b'{"url":"https://{"url":"http://'
        b'"Referer":["http://'
        b'{"callback":"parse","headers":{"Referer":["https://'
        b'"]},"meta":{"depth":'
    ),
}

#: the format :func:`pack` writes
FORMAT = 1

_WBITS = -15  # raw deflate (no header, no checksum)
# Packing a short text costs mostly the compressor's making: a small hash table (memory
# level 3: 1,024 heads, not 32,768 to clear) halves it; a row's text is too short for the
# level or the hash's size to change the result much (the same bytes for the benchmark's).
_LEVEL, _MEMORY_LEVEL = 6, 3
_CHECK_MASK = 0xFFFF


def _check(raw: bytes) -> bytes:
    return (zlib.crc32(raw) & _CHECK_MASK).to_bytes(2, "big")


def pack(text: str, url: str) -> bytes | None:
    """``text`` (a request's stored JSON text) packed beside the row's URL ``url`` (the
    dictionary's tail: the same ``url`` must be given to :func:`unpack`); None where that
    would not be smaller than the text (UTF-8)."""
    raw = text.encode()
    deflate = zlib.compressobj(_LEVEL, zlib.DEFLATED, _WBITS, _MEMORY_LEVEL,
                               zlib.Z_DEFAULT_STRATEGY,
                               DICTIONARIES[FORMAT] + url.encode())
    packed = bytes((FORMAT,)) + _check(raw) + deflate.compress(raw) + deflate.flush()
    return packed if len(packed) < len(raw) else None


def unpack(packed: bytes, url: str, row: str = "") -> str:
    """The text :func:`pack` packed into ``packed`` beside ``url``, exactly. ``row`` names
    the request's row in the error (:class:`PackedRequestError`) raised for bytes that are
    not a whole packed request of a known format whose check holds."""
    packed = bytes(packed)  # (a driver may give a memoryview)
    where = f"the stored request of the frontier row {row}" if row else "a stored request"
    if len(packed) < 3 or packed[0] not in DICTIONARIES:
        raise PackedRequestError(
            f"{where} is not a packed request this release reads (format byte "
            f"{packed[:1].hex() or 'missing'}; {len(packed)} bytes): written by a newer "
            f"release, or damaged")
    inflate = zlib.decompressobj(_WBITS, zdict=DICTIONARIES[packed[0]] + url.encode())
    try:
        raw = inflate.decompress(packed[3:])
    except zlib.error as exc:
        raise PackedRequestError(f"{where} cannot be unpacked: {exc}") from None
    if not inflate.eof or inflate.unused_data:
        raise PackedRequestError(
            f"{where} cannot be unpacked: "
            + ("truncated" if not inflate.eof else "bytes after its end"))
    if _check(raw) != packed[1:3]:
        raise PackedRequestError(
            f"{where} unpacks to other text than was packed (its check fails: the row's URL "
            f"changed, or the dictionary of format {packed[0]} is not the one it was written "
            f"with)")
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise PackedRequestError(f"{where} unpacks to bytes that are not UTF-8: {exc}") \
            from None
