"""DCP frames as display rows, for `stream` and `decode` alike: the columnar decoder
(protocol/dcp/columnar.py, the one DCP decoder of the project) turns a batch of whole
frames into dicts with the capture format's column names; this adds the value bytes when
asked for, masks SASL credentials in `raw` with the store's one masker, fills every column of
the row's set (absent fields None) and applies the output contract (cli/output.py)."""

from __future__ import annotations

from dcptool.cli.output import dcp_display
from dcptool.protocol.dcp import columnar
from dcptool.replay.store.redact import mask_sasl_credentials

_SASL_OPS = ("sasl_auth", "sasl_step")


def frame_rows(buf, offsets, lengths, *, template: dict, collections: bool = False,
               opaque_vbuckets: dict | None = None, values: bool = False, raw: bool = False,
               extra: dict | None = None) -> list[dict]:
    """One display row per whole frame at offsets/lengths of buf. `template` holds every
    column of the row set (None); `extra` is set on every row (frame bookkeeping such as
    conn, ts, direction); `opaque_vbuckets` gives responses the vbucket of their request
    and learns from the requests in this batch."""
    batch = columnar.decode_batch(buf, offsets, lengths, collections=collections,
                                  opaque_vbuckets=opaque_vbuckets)
    rows = columnar.to_rows(batch, raw=raw)
    out = []
    for r, off, ln in zip(rows, offsets.tolist(), lengths.tolist()):
        d = template.copy()
        if extra:
            d.update(extra)
        d.update(r)
        sasl = d.get("op") in _SASL_OPS
        if values and d.get("value_len") is not None:   # a SASL payload shows as '*' bytes
            d["value"] = b"*" * d["value_len"] if sasl else bytes(buf[off + ln - d["value_len"]:off + ln])
        if raw and sasl:
            d["raw"] = mask_sasl_credentials(bytes(d["raw"]))
        out.append(dcp_display(d))
    return out
