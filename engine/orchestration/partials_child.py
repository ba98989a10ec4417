"""The partial-transcript decoding process (started by engine.partials).

Reads length-prefixed msgpack frames ``[kind, session_id, generation, pcm]`` on stdin and
writes ``[session_id, generation, text]`` frames on stdout. An empty frame, or the end of
stdin (the parent is gone), ends it. It ignores SIGINT and SIGTERM: a Ctrl-C or a SIGTERM
sent to the whole process group reaches it too, and the parent, which shuts down in order,
stops it through its stdin (or kills it if it does not stop).
"""

from __future__ import annotations

import signal
import struct
import sys
from typing import IO, TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from engine.stages.asr_pocketsphinx import PocketsphinxStream

_LEN = struct.Struct("<I")
_WARM_DECODERS = 2


def read_frame(stream: IO[bytes]) -> bytes | None:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    size = _LEN.unpack(head)[0]
    data = stream.read(size)
    return data if len(data) == size else None


def write_frame(stream: IO[bytes], payload: bytes) -> None:
    stream.write(_LEN.pack(len(payload)) + payload)
    stream.flush()


def main(max_streams: int) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the parent stops this process (see above)
    from engine.stages.asr_pocketsphinx import PocketsphinxStream

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    free = [PocketsphinxStream() for _ in range(min(_WARM_DECODERS, max_streams))]
    try:
        _serve(stdin, stdout, free, max_streams)
    except BrokenPipeError:  # the parent is gone: nobody reads the partials any more
        pass
    return 0


def _serve(
    stdin: IO[bytes], stdout: IO[bytes], free: list[PocketsphinxStream], max_streams: int
) -> None:
    from engine.stages.asr_pocketsphinx import PocketsphinxStream

    streams: dict[str, PocketsphinxStream] = {}
    decode = msgspec.msgpack.Decoder(tuple[str, str, int, bytes])
    encode = msgspec.msgpack.Encoder()
    while (frame := read_frame(stdin)) is not None and frame:
        kind, sid, gen, pcm = decode.decode(frame)
        stream = streams.get(sid)
        if kind == "feed":
            if stream is None:
                if len(streams) >= max_streams:
                    continue
                stream = streams[sid] = free.pop() if free else PocketsphinxStream()
            text = stream.feed(pcm)
            if text:
                write_frame(stdout, encode.encode((sid, gen, text)))
        elif stream is not None:
            stream.reset()
            if kind == "drop":
                free.append(streams.pop(sid))


if __name__ == "__main__":
    raise SystemExit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 8))
