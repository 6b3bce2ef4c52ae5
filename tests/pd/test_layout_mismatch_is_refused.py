"""Workers whose KV layouts differ are refused at the handshake, with an error that names the field and both
values; the request fails cleanly and both workers keep serving matching peers."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.pd.conftest import start_decode, start_prefill, wait_pool_idle
from tests.pd.faults import pair


@pytest.mark.parametrize("flags,field,values", [
    (("--page-size", "8"), "page_size", ("4", "8")),
    (("--kv-cache-dtype", "bfloat16"), "dtype", ("float32", "bfloat16")),
], ids=["page-size", "kv-cache-dtype"])
def test_layout_mismatch_names_the_field(tiny_model_dir: Path, flags: tuple[str, str], field: str,
                                         values: tuple[str, str]) -> None:
    prefill, bport = start_prefill(tiny_model_dir)  # page size 4, float32 KV
    decode = start_decode(tiny_model_dir, *flags)
    try:
        prefill.wait_ready(), decode.wait_ready()
        p, d = pair(prefill, bport, decode, 401, list(range(10, 40)))
        d.wait()
        msg = d.body_out["error"]["message"]
        assert d.status == 502 and field in msg and all(v in msg for v in values), d.body_out
        p.wait()
        assert p.status != 200
        wait_pool_idle(prefill), wait_pool_idle(decode)
    finally:
        prefill.stop(), decode.stop()
