"""Workers whose KV layouts differ are refused at the handshake, with an error that names the field and both
values; the request fails cleanly and both workers keep serving matching peers."""
from __future__ import annotations

from pathlib import Path

from tests.pd.conftest import start_decode, start_prefill, wait_pool_idle
from tests.pd.faults import pair


def test_page_size_mismatch_names_the_field(tiny_model_dir: Path) -> None:
    prefill, bport = start_prefill(tiny_model_dir)  # page size 4
    decode = start_decode(tiny_model_dir, "--page-size", "8")
    try:
        prefill.wait_ready(), decode.wait_ready()
        p, d = pair(prefill, bport, decode, 401, list(range(10, 40)))
        d.wait()
        msg = d.body_out["error"]["message"]
        assert d.status == 502 and "page_size" in msg and "4" in msg and "8" in msg, d.body_out
        p.wait()
        assert p.status != 200
        wait_pool_idle(prefill), wait_pool_idle(decode)
    finally:
        prefill.stop(), decode.stop()
