"""A room that fails to open for a reason other than the transfer (a defect on our side, not the peer) fails its
request alone, with a 500: the decode step goes on, the room's transfer slot comes back, its pages return to the
pool after the quarantine, and the engine keeps serving. Driven in process through the decode role's hooks with a
transfer manager whose receivers cannot be built (nothing else here can make one fail that way)."""
from __future__ import annotations

from pathlib import Path

from decode_worker.config import DecodeConfig
from decode_worker.role import DecodeRole
from engine.request import Abort, KVTicket
from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core


class ReceiversBreak:
    def create_receiver(self, room: int, host: str, port: int) -> None:
        raise RuntimeError(f"no receiver for room {room}")

    def close(self) -> None:
        pass


def test_each_room_that_cannot_open_fails_its_request_and_gives_everything_back(tiny_model_dir: Path) -> None:
    role = DecodeRole(ReceiversBreak(), DecodeConfig(max_transfer_rooms=2, kv_quarantine=0.0), "d0")
    core = make_core(tiny_model_dir, role=role, disable_radix_cache=True)  # so idle means every page free
    free = core.allocator.available
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    pd = []
    for i in range(3):  # more than the rooms: the third waits for a slot the first two give back
        req = core.make_request(list(range(5 + i, 40 + i)), params, detokenize=False)
        req.kv_ticket = KVTicket(id=100 + i, host="127.0.0.1", port=9)
        pd.append(req)
        role.add(core, req)
    local = core.make_request(list(range(7, 30)), params, detokenize=False)
    role.add(core, local)
    for _ in range(50):
        if all(r.finished for r in pd) and local.finished:
            break
        core.step()
    for req in pd:
        assert req.finish_reason == "abort" and isinstance(req.finish_detail, Abort), req.finish_reason
        assert req.finish_detail.status == 500 and f"room {req.kv_ticket.id}" in req.finish_detail.message
    assert local.finish_reason == "length" and len(local.output_ids) == 4  # the engine kept serving
    assert sorted(role.free_slots) == [0, 1] and not role.rooms
    for _ in range(3):  # the quarantine (0 s here) hands the pages back on the next steps
        core.step()
    assert not role.quarantine and core.allocator.available == free
    core.check_integrity()
