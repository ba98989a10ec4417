"""The simulated-GPU ladder's workload misses like people do (issue 38; bench/sim_workload.py):
against the real server on the four-device simulated H200 (configs/sim-h200.yaml), turns with
a pause inside make the engine guess wrongly and throw the draft away, interrupted answers
end ``cancelled`` and are counted as barge-ins, and batch speech beside them is answered."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.sim_workload import Figures, batch_speech, make_turn, session
from tests.server.harness import ROOT, UNIT, running_server


def test_a_turn_with_a_pause_inside_is_one_the_guess_gets_wrong() -> None:
    paused = make_turn(7, wrong_pct=100.0)
    whole = make_turn(7, wrong_pct=0.0)
    assert paused.paused and not whole.paused
    assert make_turn(7, 100.0).frames == paused.frames  # the same seed, the same audio
    assert make_turn(8, 100.0).frames != paused.frames  # every turn its own


@pytest.mark.long  # ~20 s of simulated sessions: make test-long
def test_the_workload_makes_wrong_guesses_barge_ins_and_batch_speech(tmp_path: Path) -> None:
    raw = yaml.safe_load((ROOT / "configs" / "sim-h200.yaml").read_text())
    cfg = tmp_path / "sim.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    apps: list[Any] = []
    with running_server(cfg, apps=apps) as addr:
        fig = Figures()

        async def main() -> None:
            until = time.monotonic() + 14.0 * UNIT
            await asyncio.gather(
                *(
                    session(addr, until, fig, 90 + i, wrong_pct=100.0, bargein_pct=50.0)
                    for i in (0, 1)
                ),
                batch_speech(addr, until, 0.5, fig, seed=3),
            )

        asyncio.run(main())
        orch = apps[0].state.engine.engine.orchestrator
        spec = orch.speculation
        # every turn had a pause inside: its guess was not the turn, its draft was dropped
        assert fig.paused_turns >= 2
        assert spec.started - spec.used >= fig.paused_turns - 1
        assert orch.counters.drafts["dropped"] >= 1
        wasted = sum(f.outputs["draft_wasted"] for f in orch.scheduling_figures().values())
        assert wasted > 0
        assert fig.bargeins >= 1 and not fig.failed
        assert fig.batch_requests >= 1 and not fig.batch_failed
        assert len(fig.batch_first_s) == fig.batch_requests
        assert fig.ttfa_s and fig.answers >= 3
