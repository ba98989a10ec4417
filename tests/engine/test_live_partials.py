"""LivePartials (engine/orchestration/live_partials.py): heard audio is fed under the input's
generation, text comes back from the transcriber's thread onto the loop, and text of an
input already committed or cleared (an older generation) is dropped."""

from __future__ import annotations

import asyncio
import threading

from duplex_contract.session_events import UserTranscript
from engine.duplex.effects import Effects
from engine.orchestration.live_partials import LivePartials, OnPartial
from tests.engine.conftest import run
from tests.engine.parts_fakes import Emitted, session, settle


class Feed:
    def __init__(self) -> None:
        self.ops: list[tuple[object, ...]] = []
        self.on_partial: OnPartial | None = None

    def feed(self, session_id: str, generation: int, pcm: bytes) -> None:
        self.ops.append(("feed", session_id, generation, pcm))

    def reset(self, session_id: str) -> None:
        self.ops.append(("reset", session_id))

    def drop(self, session_id: str) -> None:
        self.ops.append(("drop", session_id))

    def close(self) -> None:
        self.ops.append(("close",))


def _live(**settings: object) -> tuple[LivePartials, Feed, Emitted]:
    feed, emitted = Feed(), Emitted()

    def open_feed(on_partial: OnPartial) -> Feed:
        feed.on_partial = on_partial
        return feed

    sessions = {"sess_a": session("sess_a", **settings)}
    languages = {"sess_a": str(settings.get("language", "en"))}
    live = LivePartials(
        open_feed, asyncio.get_running_loop(), sessions, emitted, languages.__getitem__
    )
    return live, feed, emitted


def _from_thread(feed: Feed, sid: str, generation: int, text: str) -> None:
    assert feed.on_partial is not None
    t = threading.Thread(target=feed.on_partial, args=(sid, generation, text))
    t.start()
    t.join()


def test_heard_audio_is_fed_under_the_inputs_generation() -> None:
    async def main() -> None:
        live, feed, _ = _live()
        live.on_effects(Effects(heard=[("sess_a", b"\1\2")]))
        live.on_effects(Effects(input_reset=["sess_a"], heard=[("sess_a", b"\3\4")]))
        assert feed.ops == [
            ("feed", "sess_a", 0, b"\1\2"),
            ("reset", "sess_a"),
            ("feed", "sess_a", 1, b"\3\4"),
        ]

    run(main())


def test_a_language_the_model_lacks_gets_no_partials() -> None:
    async def main() -> None:
        live, feed, _ = _live(language="fr")
        live.on_effects(Effects(heard=[("sess_a", b"\1\2")]))
        assert feed.ops == []

    run(main())


def test_text_of_the_current_input_is_emitted_on_the_loop() -> None:
    async def main() -> None:
        _, feed, emitted = _live()
        _from_thread(feed, "sess_a", 0, "what is")
        assert emitted.out == []  # not on the transcriber's thread
        await settle()
        fence = session("sess_a").fence
        assert emitted.events() == [UserTranscript(fence=fence, text="what is", final=False)]

    run(main())


def test_text_of_committed_input_or_a_gone_session_is_dropped() -> None:
    async def main() -> None:
        live, feed, emitted = _live()
        live.on_effects(Effects(input_reset=["sess_a"]))  # committed: generation 1
        _from_thread(feed, "sess_a", 0, "late words")
        _from_thread(feed, "sess_gone", 0, "nobody")
        await settle()
        assert emitted.out == []
        live.drop("sess_a")
        live.close()
        assert feed.ops[-2:] == [("drop", "sess_a"), ("close",)]

    run(main())
