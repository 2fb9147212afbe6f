"""The `Engine` step loop: schedule → prepare inputs → forward → sample → outputs.

One engine serves one role. `aggregated` runs both phases with chunked prefill;
`prefill` stops each request after its first token and keeps its blocks pinned for
export; `decode` starts requests from KV imported into its own pool. The class is
synchronous and not thread-safe: `AsyncEngine` drives it from one thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.block_pool import BlockPool
from engine.config import ConfigError, EngineConfig, Role, resolve_device, resolve_dtype
from engine.cpu_kernels import select_decode_kernel
from engine.detokenizer import IncrementalDetokenizer
from engine.draft_model import DraftModelProposer
from engine.errors import InvalidRequest
from engine.external_kv import ExternalKVCache, check_chunk_size
from engine.hashing import model_fingerprint
from engine.kv_cache import KVCache, num_blocks_for
from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import KVEvent
from engine.model import LlamaModel
from engine.model_runner import ModelRunner
from engine.quant import activation_dtype, packs_weights
from engine.request import FinishReason, Request, RequestMetrics, RequestOutput, RequestStatus, ResumeState
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.speculative import NgramProposer, Proposer, accepted_prefix
from engine.stats import EngineStats
from engine.structured import GrammarMatcher, Grammars
from engine.tokenizer import load_tokenizer
from engine.weights import load_checkpoint, resolve_checkpoint

log = logging.getLogger(__name__)

# Steps in a row that fail every request they schedule before the engine gives up
# (its replica's health check then fails and Serve replaces it).
MAX_FAILED_STEPS = 3


@dataclass(frozen=True)
class ExportedKV:
    """Blocks a prefill request left pinned for a handoff (one reference each)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass(frozen=True)
class MovedSequence:
    """A decoding sequence taken out of this engine (`move_out`), its KV blocks pinned
    (one reference each) for another engine to import and continue it: `block_ids`
    hold the KV of every token but the last, which the next step feeds."""

    request_id: str
    block_ids: list[int]
    token_ids: list[int]
    resume: ResumeState

    @property
    def num_computed_tokens(self) -> int:
        return len(self.token_ids) - 1


@dataclass
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int


def expected_model_fingerprint(cfg: EngineConfig) -> str:
    """`Engine.model_fingerprint` of an engine built from `cfg`, without loading it
    (routers hash prompts with it before any replica reports its own)."""
    device = resolve_device(cfg.device)
    dtype = activation_dtype(cfg.weight_quant, cfg.dtype, resolve_dtype(cfg.dtype, device), device)
    return model_fingerprint(resolve_checkpoint(cfg.model).model_id, dtype, cfg.weight_quant)


class Engine:
    """Owns the model, the KV cache, the block pool and the scheduler of one replica."""

    def __init__(self, cfg: EngineConfig | None = None, role: Role = "aggregated", model: LlamaModel | None = None,
                 share_kv: bool = False):
        """`model` lets several engines (tests, benchmarks) share one set of weights.
        `share_kv`: the KV tensor in shared memory, for a replica that runs this engine
        in a child process and registers the tensor with its transfer backend itself."""
        cfg = cfg or EngineConfig()
        self.cfg = cfg
        self.role = role
        self.device = resolve_device(cfg.device)
        self.dtype = activation_dtype(cfg.weight_quant, cfg.dtype, resolve_dtype(cfg.dtype, self.device), self.device)
        self.checkpoint = resolve_checkpoint(cfg.model)
        self.tokenizer = load_tokenizer(cfg.model)

        if model is None:
            model_cfg, state = load_checkpoint(self.checkpoint, self.dtype)
            packed = packs_weights(cfg.packed_weights, self.device, self.dtype, cfg.weight_quant)
            model = LlamaModel(model_cfg, state, self.dtype, self.device, cfg.weight_quant, packed)
        model_cfg = model.cfg
        self.dtype, self.device = model.dtype, model.device
        if cfg.max_model_len > model_cfg.max_position_embeddings:
            raise ConfigError(
                "max_model_len", f"{cfg.max_model_len} exceeds the model's context {model_cfg.max_position_embeddings}"
            )
        self.model_config = model_cfg
        self.model = model
        self.eos_token_ids = set(model_cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

        num_blocks = num_blocks_for(cfg, model_cfg, self.dtype)
        self.kv_cache = KVCache(model_cfg, num_blocks, cfg.block_size, self.dtype, self.device, shared=share_kv)
        decode_kernel = select_decode_kernel(cfg.decode_attention, self.device)
        self.runner = ModelRunner(model, self.kv_cache, cfg.block_size, decode_kernel)
        self.block_pool = BlockPool(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.block_pool, cfg.block_size, self.model_fingerprint)
        self.proposer = self._proposer(role)
        self.scheduler = Scheduler(self.kv_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   self.proposer.propose_all if self.proposer is not None else None)
        self.sampler = Sampler()
        self.grammars = Grammars(self.tokenizer, model_cfg.vocab_size)
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._exports: dict[str, ExportedKV] = {}
        # Called on the engine thread the moment a prefill-role request finishes, so the
        # owner (prefill/server.py) leases the blocks before any await can be cancelled.
        # Without it, exports wait in `take_export`.
        self.on_export: Callable[[ExportedKV], None] | None = None
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self.num_steps = 0
        # Speculative decoding's counters: draft tokens scored and accepted, and the
        # (request, step) pairs that verified drafts.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0
        self._failed_steps = 0  # steps in a row in which every scheduled request failed

    def _proposer(self, role: Role) -> Proposer | None:
        """Speculative decoding's drafter, in the roles that decode (engine/speculative.py)."""
        spec = self.cfg.speculative
        if not spec.enabled or role == "prefill":
            return None
        if spec.method == "draft":
            return DraftModelProposer.load(spec, self.cfg.max_model_len, self.cfg.block_size, self.model,
                                           self.checkpoint, self.cfg.packed_weights, self.runner.decode_kernel)
        return NgramProposer(spec, self.cfg.max_model_len)

    # ------------------------------------------------------------ identity
    @property
    def model_id(self) -> str:
        return self.model_config.model_id

    @property
    def model_fingerprint(self) -> str:
        """Part of every block hash: KV from another model or dtype never matches."""
        return model_fingerprint(self.checkpoint.model_id, self.dtype, self.cfg.weight_quant)

    # ------------------------------------------------------------ external KV
    def attach_external_kv(self, cache: ExternalKVCache | None) -> None:
        """Consult `cache` after the block pool on admission and give it each
        completed prompt's KV (engine/external_kv.py). Call between steps."""
        if cache is not None:
            check_chunk_size(cache.chunk_size, self.cfg.block_size)
        self.kv_manager.external = cache

    # ------------------------------------------------------------ admission
    def tokenize_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        self.validate_prompt(ids)
        return ids

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequest("prompt", "must not be empty")
        if len(ids) >= self.cfg.max_model_len:
            raise InvalidRequest(
                "prompt",
                f"{len(ids)} tokens do not fit this model's maximum context length of "
                f"{self.cfg.max_model_len} tokens (at least one token must be generated)",
            )
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InvalidRequest("prompt", f"token ids must be integers in [0, {vocab})")

    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        grammar: GrammarMatcher | None = None,
        cache_salt: str | None = None,
        fork_of: str | None = None,
    ) -> str:
        """`grammar`: the structured output's matcher, when the caller compiled it off
        this thread (`grammars.matcher`); built here otherwise. `cache_salt`: the
        request's KV namespace (engine/hashing.py `chain_root`). `fork_of`: another
        choice of the same request (`n` > 1) whose prompt KV this one forks if that one
        is here (`Scheduler`); computed as any request otherwise."""
        sampling = sampling or SamplingParams()
        sampling.validate()
        sampling.check_vocab(self.model_config.vocab_size)
        ids = self.tokenize_prompt(prompt)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.scheduler.requests or request_id in self._detoks:
            raise InvalidRequest("request_id", f"{request_id!r} is already running")
        req = Request(request_id, ids, sampling, priority, stop_after_first_token=self.role == "prefill",
                      cache_salt=cache_salt, fork_of=fork_of)
        self._start(req, grammar=grammar)
        return request_id

    def _start(self, req: Request, context_ids: list[int] | None = None, grammar: GrammarMatcher | None = None,
               resume: ResumeState | None = None) -> None:
        if req.sampling.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.sampling.seed)
            if resume is not None and resume.generator_state is not None:
                req.generator.set_state(torch.frombuffer(bytearray(resume.generator_state), dtype=torch.uint8))
        if req.sampling.structured is not None:  # a request taken over replays its tokens
            req.grammar = grammar or self.grammars.matcher(req.sampling.structured, req.output_token_ids)
        stop, include_stop = req.sampling.stop, req.sampling.include_stop_str_in_output
        self._detoks[req.request_id] = (
            IncrementalDetokenizer.resume(self.tokenizer, resume.detokenizer, stop, include_stop) if resume
            else IncrementalDetokenizer(self.tokenizer, context_ids or req.prompt_token_ids, stop, include_stop)
        )
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, FinishReason.ABORT, "")
        return True

    def move_out(self, request_id: str) -> MovedSequence | None:
        """Take a decoding sequence out of this engine with its KV blocks pinned, to
        continue in another (`add_imported_request` with `resume`); its stream ends
        with finish reason MOVED. None when it is not decoding (waiting, prefilling,
        preempted, or not here): it stays."""
        req = self.scheduler.requests.get(request_id)
        if (req is None or req.status is not RequestStatus.RUNNING or req.num_output_tokens == 0
                or req.num_computed_tokens != req.num_tokens - 1):
            return None
        gen = req.generator
        resume = ResumeState(
            num_output_tokens=req.num_output_tokens,
            generator_state=None if gen is None else bytes(gen.get_state().numpy()),
            detokenizer=self._detoks[request_id].state(),
            num_cached_tokens=max(req.num_cached_tokens, 0),
        )
        blocks = self.scheduler.finish(req, FinishReason.MOVED, keep_blocks=True)
        if self.proposer is not None:
            self.proposer.forget(request_id)
        needed = self.kv_manager.blocks_needed(req.num_computed_tokens)
        if len(blocks) > needed:  # a slot the next step would have written
            self.kv_manager.release_blocks(blocks[needed:])
            blocks = blocks[:needed]
        del self._detoks[request_id]
        self._pending.append(self._output(req, [], "", FinishReason.MOVED))
        return MovedSequence(request_id, blocks, list(req.token_ids), resume)

    # ------------------------------------------------------------ prefill export / decode import
    def take_export(self, request_id: str) -> ExportedKV | None:
        return self._exports.pop(request_id, None)

    def release_blocks(self, block_ids: list[int]) -> None:
        """End of a lease (release, reject or expiry), or a failed import."""
        self.kv_manager.release_blocks(block_ids)

    def reserve_import(self, num_tokens: int) -> list[int] | None:
        """Blocks for KV arriving from a prefill replica, or None when full (→ Reject)."""
        n = self.kv_manager.blocks_needed(num_tokens)
        if n > self.block_pool.num_free_blocks or len(self.scheduler.running) >= self.cfg.max_num_seqs:
            return None
        return self.block_pool.allocate(n)

    def add_imported_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        sampling: SamplingParams,
        block_ids: list[int] | None,
        num_cached_tokens: int = 0,
        grammar: GrammarMatcher | None = None,
        cache_salt: str | None = None,
        resume: ResumeState | None = None,
    ) -> None:
        """Join the running batch with the prompt's KV already in `block_ids`; the next
        step computes the first token's KV and samples the second. `block_ids=None`
        means the import failed: recompute the prompt here (counted by the caller).
        The imported blocks enter this pool's prefix cache under `cache_salt`'s chain.

        With `resume`, a sequence another engine moved out (`move_out`): the last
        `resume.num_output_tokens` of `prompt_token_ids + [first_token]` are its output
        so far, and its sampler, detokenizer and grammar continue where they stood."""
        sampling.validate()
        sampling.check_vocab(self.model_config.vocab_size)
        self.validate_prompt(prompt_token_ids)
        tokens = [*prompt_token_ids, first_token]
        num_output = 1 if resume is None else resume.num_output_tokens
        if not 1 <= num_output < len(tokens):
            raise InvalidRequest("resume", f"{num_output} output tokens of a sequence of {len(tokens)}")
        req = Request(request_id, tokens[:-num_output], sampling, cache_salt=cache_salt)
        req.token_ids = tokens
        req.num_cached_tokens = num_cached_tokens if resume is None else resume.num_cached_tokens
        if block_ids is not None:
            req.block_ids = list(block_ids)
            req.num_computed_tokens = len(prompt_token_ids)
            req.status = RequestStatus.RUNNING
            self.kv_manager.cache_computed_blocks(req)
        self._start(req, context_ids=req.token_ids, grammar=grammar, resume=resume)

    # ------------------------------------------------------------ the step
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """One forward over the scheduled batch. An exception inside it fails only the
        requests that cause it (found by running them alone), never the engine: they
        finish with `error` set and their blocks freed. `MAX_FAILED_STEPS` steps in a
        row that make no progress at all mean the engine itself is broken: raise."""
        sched = self.scheduler.schedule()
        outputs, self._pending = self._pending, []
        if not sched:
            return outputs
        if sched.block_copies:
            self.kv_cache.copy_blocks(sched.block_copies)
        sched, logits = self._execute(sched, outputs)
        if not sched:
            self._failed_steps += 1
            if self._failed_steps >= MAX_FAILED_STEPS:
                raise RuntimeError(f"{self._failed_steps} engine steps in a row failed every request")
            return outputs
        self._failed_steps = 0
        sampling = [s for s in sched.scheduled if s.samples]  # before commit moves progress
        self.scheduler.commit(sched)
        self.num_steps += 1
        if sampling:
            for s, tokens, logprobs in self._sample(logits, sampling, outputs):
                try:
                    outputs.append(self._append_sampled(s, tokens, logprobs))
                except Exception as e:
                    outputs.append(self._fail(s.request, e))
        return outputs

    def _append_sampled(self, s: ScheduledRequest, tokens: list[int], logprobs: list) -> RequestOutput:
        """A plain step's one token, or a verified draft's accepted run plus the
        model's next token, as one output."""
        req = s.request
        draft = s.draft_token_ids
        if not draft:
            return self._append_token(req, tokens[0], logprobs[0])
        accepted = accepted_prefix(draft, tokens)
        req.num_draft_tokens += len(draft)
        req.num_accepted_tokens += accepted
        self.num_draft_tokens += len(draft)
        self.num_accepted_tokens += accepted
        self.num_verify_steps += 1
        out = self._append_token(req, tokens[0], logprobs[0])
        for i in range(1, accepted + 1):
            if out.finished:
                break
            out = _merged(out, self._append_token(req, tokens[i], logprobs[i]))
        if not out.finished:  # the accepted drafts' KV was written in this step
            req.num_computed_tokens += accepted
            self.kv_manager.cache_computed_blocks(req)
        return out

    def _execute(self, sched: SchedulerOutput, outputs: list[RequestOutput]):
        """(what ran, its logits). When the batch raises, each request runs alone: those
        that raise alone are failed and the rest run again together."""
        try:
            return sched, self.runner.execute(sched)
        except Exception as e:
            log.exception("engine step over %d requests failed; isolating the cause", len(sched.scheduled))
            first_error = e
        bad = set()
        for s in sched.scheduled:
            try:
                self.runner.execute(SchedulerOutput(decodes=[s]) if s.num_new_tokens == 1
                                    else SchedulerOutput(prefills=[s]))
            except Exception as e:
                bad.add(s.request.request_id)
                outputs.append(self._fail(s.request, e))
        rest = SchedulerOutput(
            decodes=[s for s in sched.decodes if s.request.request_id not in bad],
            prefills=[s for s in sched.prefills if s.request.request_id not in bad],
        )
        if not rest:
            return rest, None
        try:
            return rest, self.runner.execute(rest)
        except Exception as e:  # fails together, never alone: none of them can go on
            for s in rest.scheduled:
                outputs.append(self._fail(s.request, e if bad else first_error))
            return SchedulerOutput(), None

    def _sample(self, logits: torch.Tensor, sampling: list[ScheduledRequest], outputs: list[RequestOutput]):
        """(scheduled request, tokens, logprobs) for each: one token, or one per scored
        draft position plus one. A request whose sampling raises fails alone."""
        rows = [s.request for s in sampling for _ in range(s.num_sampled_rows)]
        try:
            sampled = self.sampler(logits, rows)
            return list(_by_request(sampling, sampled.token_ids, sampled.logprobs))
        except Exception:
            log.exception("sampling %d requests failed; sampling them one by one", len(sampling))
        out = []
        start = 0
        for s in sampling:
            n = s.num_sampled_rows
            try:
                part = self.sampler(logits[start : start + n], [s.request] * n)
                out.append((s, part.token_ids, part.logprobs))
            except Exception as e:
                outputs.append(self._fail(s.request, e))
            start += n
        return out

    def _fail(self, req: Request, error: BaseException) -> RequestOutput:
        """End one request because of an error inside the engine; its blocks are freed."""
        log.error("request %s failed inside the engine: %s: %s", req.request_id, type(error).__name__, error)
        self._finish(req, FinishReason.ABORT, None)
        out = self._output(req, [], "", FinishReason.ABORT)
        out.error = f"{type(error).__name__}: {error}"[:500]
        return out

    def _append_token(self, req: Request, token: int, logprob) -> RequestOutput:
        if req.grammar is not None and not req.grammar.advance([token]):
            return self._dead_end(req, token)
        req.token_ids.append(token)
        sp = req.sampling
        reason: FinishReason | None = None
        if (not sp.ignore_eos and token in self.eos_token_ids) or token in sp.stop_token_ids:
            reason = FinishReason.STOP
        elif req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.cfg.max_model_len:
            reason = FinishReason.LENGTH
        if req.grammar is not None and req.grammar.is_stopped and reason is None:  # the document is complete
            reason = FinishReason.STOP
        text, stop_hit = self._detoks[req.request_id].add([token])
        if stop_hit:
            reason = FinishReason.STOP
        if reason is None and req.stop_after_first_token:
            reason = FinishReason.PREFILL_DONE
        out = self._output(req, [token], text, reason)
        out.logprobs = None if logprob is None else [logprob]
        if reason is not None:
            out.text += self._finish(req, reason, None)
        return out

    def _dead_end(self, req: Request, token: int) -> RequestOutput:
        """End a request whose grammar refused `token` (it allows nothing more). The
        token is dropped, so the output stays a valid prefix of the grammar; the client
        gets finish_reason `grammar_dead_end`, and the blocks are freed."""
        assert req.grammar is not None
        log.warning("request %s: its grammar reached a dead end at token %d: %s", req.request_id, token,
                    req.grammar.error[:300])
        reason = FinishReason.GRAMMAR_DEAD_END
        out = self._output(req, [], "", reason)
        out.text += self._finish(req, reason, None)
        return out

    def _finish(self, req: Request, reason: FinishReason, pending_text: str | None) -> str:
        """Remove `req`; returns the held-back text. When `pending_text` is given (an
        abort), a final output is queued for the next step."""
        keep = reason is FinishReason.PREFILL_DONE
        blocks = self.scheduler.finish(req, reason, keep_blocks=keep)
        if self.proposer is not None:
            self.proposer.forget(req.request_id)
        if keep:
            export = ExportedKV(req.request_id, blocks, req.num_prompt_tokens)
            if self.on_export is not None:
                self.on_export(export)
            else:
                self._exports[req.request_id] = export
        detok = self._detoks.pop(req.request_id)
        tail = detok.flush() if reason is not FinishReason.ABORT else ""
        if pending_text is not None:
            self._pending.append(self._output(req, [], pending_text, reason))
        return tail

    def _output(self, req: Request, new_ids: list[int], text: str, reason: FinishReason | None) -> RequestOutput:
        if new_ids and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens,
            metrics=None if reason is None else _metrics(req),
        )

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Next-token logits at every position of `token_ids` ([n, vocab], fp32), in one
        prefill outside the scheduler; for reference checks and prompt logprobs."""
        self.validate_prompt(token_ids)
        blocks = self.block_pool.allocate(self.kv_manager.blocks_needed(len(token_ids)))
        try:
            return self.runner.score(token_ids, blocks)
        finally:
            self.block_pool.free(reversed(blocks))

    # ------------------------------------------------------------ observability
    def take_kv_events(self) -> list[KVEvent]:
        return self.block_pool.take_events()

    def stats(self) -> EngineStats:
        pool = self.block_pool
        ext = self.kv_manager.external_stats
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            queued_prefill_tokens=self.scheduler.num_waiting_tokens,
            kv_blocks_total=pool.num_blocks,
            kv_blocks_free=pool.num_free_blocks,
            kv_usage=pool.usage(),
            num_preemptions=self.scheduler.num_preemptions,
            num_exported=len(self._exports),
            prefix_cache_hit_rate=pool.stats.hit_rate,
            prefix_cache_evictions=pool.stats.evictions,
            prefix_cache_queried_tokens=pool.stats.queried_tokens,
            prefix_cache_hit_tokens=pool.stats.hit_tokens,
            external_kv_lookups=ext.lookups,
            external_kv_hit_tokens=ext.hit_tokens,
            external_kv_loaded_tokens=ext.loaded_tokens,
            external_kv_load_failures=ext.load_failures,
            external_kv_errors=ext.errors,
            spec_draft_tokens=self.num_draft_tokens,
            spec_accepted_tokens=self.num_accepted_tokens,
            spec_verify_steps=self.num_verify_steps,
            num_forks=self.scheduler.num_forks,
            request_ids=tuple(r.request_id for r in (*self.scheduler.waiting, *self.scheduler.running)),
        )

    # ------------------------------------------------------------ offline use
    def stream(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None) -> Iterator[RequestOutput]:
        rid = self.add_request(prompt, sampling)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        params = sampling if isinstance(sampling, Sequence) else [sampling or SamplingParams()] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        results = {
            rid: GenerationResult(rid, "", [], None, self.scheduler.requests[rid].num_prompt_tokens, 0)
            for rid in rids
        }
        pending = set(rids)
        while pending:
            for out in self.step():
                res = results.get(out.request_id)
                if res is None:
                    continue
                res.text += out.text
                res.token_ids.extend(out.new_token_ids)
                res.num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    res.finish_reason = out.finish_reason
                    pending.discard(out.request_id)
        return [results[r] for r in rids]


def _by_request(sampling: list[ScheduledRequest], tokens: list[int], logprobs: list):
    start = 0
    for s in sampling:
        n = s.num_sampled_rows
        yield s, tokens[start : start + n], logprobs[start : start + n]
        start += n


def _merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One output for two consecutive ones of the same request in one step."""
    first.new_token_ids = first.new_token_ids + then.new_token_ids
    first.text += then.text
    if first.logprobs is not None and then.logprobs is not None:
        first.logprobs = first.logprobs + then.logprobs
    first.finished, first.finish_reason = then.finished, then.finish_reason
    first.num_output_tokens, first.metrics = then.num_output_tokens, then.metrics
    return first


def _metrics(req: Request) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=req.arrival_time,
        first_scheduled_time=req.first_scheduled_time,
        first_token_time=req.first_token_time,
        finished_time=time.monotonic(),
        num_preemptions=req.num_preemptions,
        cached_tokens_by_source=dict(req.cached_tokens_by_source),
        num_draft_tokens=req.num_draft_tokens,
        num_accepted_tokens=req.num_accepted_tokens,
    )
