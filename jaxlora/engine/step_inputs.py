"""A step's inputs as one int32 array: built on the host in place, sent with one copy, unpacked in jit.

The step reads about sixteen small arrays (see `jaxlora.engine.runner`): per token [T] the token
ids, their sources, positions, adapter slots and KV write targets; per row [S] the ragged batch
(query start and length, context length, block table) and the sampling parameters. As separate jit
arguments they would be sixteen host->device copies per step, each a transfer that may queue
behind the device work in flight. Packed into one buffer they are one copy, which the runner issues
itself (`jax.device_put`) before the call; the jitted step slices the fields out at static offsets
(`StepLayout.unpack`) and the model still sees a `RaggedBatch`.

Layout of the buffer for token budget T, S rows and P pages per sequence (int32 words; float32 and
uint32 fields are stored bit for bit):

    block_tables [S * P] | q_start, q_len, kv_len, prompt_len, reset, temperature, top_k, top_p,
    seed, counter, min_p, min_tokens, repetition_penalty, presence_penalty, frequency_penalty [S each]
    | tokens, src, positions, slot_ids, write_page, write_offset [T each]

`prompt_len` and `reset` (1 when the row's first chunk is in the step) feed the token history the
penalties read (`jaxlora.engine.sampling.TokenHistory`).

The per-row part comes first, so it sits at the same offsets for every budget: a host buffer sized
for the largest budget serves a step of any budget T (which sends its first `StepLayout.size`
words). The packer allocates two such buffers once and writes each step into one of them in place
(`InputPacker`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.engine.kv_pages import PageTable
from jaxlora.engine.request import Request
from jaxlora.engine.sampling import SamplingArrays
from jaxlora.engine.scheduler import Chunk, StepPlan
from jaxlora.model import RaggedBatch

_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "counter", "min_p", "min_tokens", *_PENALTIES)
ROW_FIELDS = ("q_start", "q_len", "kv_len", "prompt_len", "reset", *_SAMPLING_FIELDS)
TOKEN_FIELDS = ("tokens", "src", "positions", "slot_ids", "write_page", "write_offset")
_FLOAT32 = ("temperature", "top_p", "min_p", *_PENALTIES)
# Fixed while a request holds its row; the penalties go to every row of a step (its history grows in
# prompt chunks too), the others to rows that sample.
_ROW_SAMPLING = tuple(
    f for f in _SAMPLING_FIELDS if f != "counter" and f not in _PENALTIES
)  # fixed while a request holds its row
_UINT32 = ("seed",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepLayout:
    """Where each field sits in a step's packed int32 buffer (module doc). Hashable: a static jit
    argument, one compiled step per budget."""

    budget: int  # T, tokens per step
    rows: int  # S, sequences per step (max_batch)
    pages_per_seq: int  # P, block-table width

    def __post_init__(self) -> None:
        if min(self.budget, self.rows, self.pages_per_seq) < 1:
            raise ValueError(
                f"budget={self.budget}, rows={self.rows} and pages_per_seq={self.pages_per_seq} must be >= 1"
            )

    @property
    def size(self) -> int:
        """Words of the packed buffer."""
        return self.rows * self.pages_per_seq + len(ROW_FIELDS) * self.rows + len(TOKEN_FIELDS) * self.budget

    @functools.cached_property
    def spans(self) -> dict[str, slice]:
        """Field name -> its words in the buffer (block_tables flat, [S * P])."""
        S, T = self.rows, self.budget
        out = {"block_tables": slice(0, S * self.pages_per_seq)}
        start = S * self.pages_per_seq
        for name in ROW_FIELDS:
            out[name], start = slice(start, start + S), start + S
        for name in TOKEN_FIELDS:
            out[name], start = slice(start, start + T), start + T
        return out

    def pack(
        self,
        *,
        tokens,
        src,
        positions,
        slot_ids,
        batch: RaggedBatch,
        sampling: SamplingArrays,
        prompt_len=None,
        reset=None,
    ) -> np.ndarray:
        """The step's fields as host arrays (`unpack`'s output, or what tools build themselves) ->
        packed [size] int32. The engine writes its buffers in place instead (`InputPacker`).
        prompt_len and reset [S] (the token history's) default to zeros."""
        out = np.zeros(self.size, np.int32)
        views = _views(out, self)
        given = dict(tokens=tokens, src=src, positions=positions, slot_ids=slot_ids)
        given.update(prompt_len=np.zeros(self.rows, np.int32) if prompt_len is None else prompt_len)
        given.update(reset=np.zeros(self.rows, np.int32) if reset is None else reset)
        given.update({k: getattr(batch, k) for k in ("q_start", "q_len", "kv_len", "block_tables")})
        given.update({k: getattr(batch, k) for k in ("write_page", "write_offset")})
        given.update({k: getattr(sampling, k) for k in _SAMPLING_FIELDS})
        for name, value in given.items():
            value = np.asarray(value)
            if value.shape != views[name].shape:
                raise ValueError(f"{name} has shape {value.shape}, the layout wants {views[name].shape}")
            views[name][...] = value
        return out

    def unpack(self, packed: jax.Array) -> dict:
        """packed [size] int32 (a traced array inside the step) -> the step's fields: tokens, src,
        positions, slot_ids [T] int32, batch (RaggedBatch), sampling (SamplingArrays [S]),
        prompt_len [S] int32, reset [S] bool."""
        if packed.shape != (self.size,) or packed.dtype != jnp.int32:
            raise ValueError(f"packed inputs {packed.shape} {packed.dtype}, expected ({self.size},) int32")
        f = {name: packed[span] for name, span in self.spans.items()}
        for name in _FLOAT32:
            f[name] = jax.lax.bitcast_convert_type(f[name], jnp.float32)
        for name in _UINT32:
            f[name] = jax.lax.bitcast_convert_type(f[name], jnp.uint32)
        batch = RaggedBatch(
            q_start=f["q_start"],
            q_len=f["q_len"],
            kv_len=f["kv_len"],
            block_tables=f["block_tables"].reshape(self.rows, self.pages_per_seq),
            write_page=f["write_page"],
            write_offset=f["write_offset"],
        )
        sampling = SamplingArrays(**{k: f[k] for k in _SAMPLING_FIELDS})
        return dict(
            tokens=f["tokens"],
            src=f["src"],
            positions=f["positions"],
            slot_ids=f["slot_ids"],
            batch=batch,
            sampling=sampling,
            prompt_len=f["prompt_len"],
            reset=f["reset"] != 0,
        )


@dataclasses.dataclass(frozen=True)
class HostInputs:
    """A packed step on the host, ready to send.

    buffer: [layout.size] int32, a view of the packer's buffer `index`: rewritten by a later `pack`.
    has_adapter: some token of the step reads an adapter slot (slot != 0).
    samples: some row of the step needs the sampler: it samples with a temperature, EOS is banned
      for it (min_tokens), it has a penalty, or it asks for logprobs.
    extended: some row of the step has a penalty (the sampler keeps the token history), or some
      row that samples asks for logprobs: the sampler's extended variant.
    """

    layout: StepLayout
    buffer: np.ndarray
    index: int
    has_adapter: bool
    samples: bool
    extended: bool = False


class InputPacker:
    """Builds each step's packed inputs in preallocated host buffers, with numpy over whole fields
    and a Python loop over the step's prompt chunks only (the decode rows come as arrays, and the
    per-token work is vectorised).

    Buffers: NUM_BUFFERS of them, used in turn. A host->device copy may read its source after
    `jax.device_put` returns (on CPU it runs when the device gets to it, behind the work queued
    before it), so a buffer is rewritten only once its previous copy is done: the caller waits for
    that copy (`Runner.pack`). In the engine's loop it has long finished: the step that read it has
    run, and its ids were read, before the buffer comes round again.

    Rows: what stays fixed while a request holds a row (its block table's pages so far, adapter slot,
    sampling parameters, prompt length) is kept on the host across steps, per row. It is written
    when a chunk of the row starts where the request's cached prefix ends (`Request.num_cached`, 0
    without prefix caching), which is how every request starts on a row (new, or recomputed after
    preemption: the scheduler gives every admitted request its pages afresh, cached ones first);
    otherwise only the pages the row took since the packer last saw it are appended (a
    running request's pages only ever grow). A step's buffer gets the rows in the step; the step
    reads nothing of a row with q_len = 0.

    Not thread-safe: the engine loop owns it.
    """

    NUM_BUFFERS = 2

    def __init__(self, *, rows: int, pages_per_seq: int, page_size: int, num_pages: int, budgets: tuple[int, ...]):
        self.page_size = page_size
        self.num_pages = num_pages  # a write to page num_pages is dropped: where padding tokens write
        self.layouts = {T: StepLayout(budget=T, rows=rows, pages_per_seq=pages_per_seq) for T in budgets}
        size = max(lay.size for lay in self.layouts.values())
        self.buffers = [np.zeros(size, np.int32) for _ in range(self.NUM_BUFFERS)]
        # [buffer][budget]: field name -> view of that buffer.
        self._fields = [{T: _views(buf, lay) for T, lay in self.layouts.items()} for buf in self.buffers]
        self.next_buffer = 0  # the buffer the next pack writes
        # Per row, for the request on it (class doc).
        self._tables = np.zeros((rows, pages_per_seq), np.int32)  # block table
        self._pages_seen = np.zeros(rows, np.int32)  # entries of _tables written
        self._slot = np.zeros(rows, np.int32)
        self._num_prompt = np.zeros(rows, np.int32)
        self._sampling = {  # the sampling fields but the counter
            "temperature": np.zeros(rows, np.float32),
            "top_k": np.zeros(rows, np.int32),
            "top_p": np.ones(rows, np.float32),
            "seed": np.zeros(rows, np.uint32),
            "min_p": np.zeros(rows, np.float32),
            "min_tokens": np.zeros(rows, np.int32),
            "repetition_penalty": np.ones(rows, np.float32),
            "presence_penalty": np.zeros(rows, np.float32),
            "frequency_penalty": np.zeros(rows, np.float32),
        }
        self._penalised = np.zeros(rows, bool)  # any penalty off its neutral value
        self._logprobs = np.zeros(rows, bool)  # asks for logprobs

    def reset(self) -> None:
        """Forgets every row's block table (the page pool was replaced)."""
        self._pages_seen.fill(0)

    def pack(self, plan: StepPlan, pages: PageTable) -> HostInputs:
        """The plan's inputs, written into buffer `next_buffer` (whose previous copy must be done)."""
        k = self.next_buffer
        self.next_buffer = (k + 1) % self.NUM_BUFFERS
        layout = self.layouts[plan.budget]
        f = self._fields[k][plan.budget]
        buffer = self.buffers[k][: layout.size]
        self._clear(f)
        if not len(plan.decode.requests) and not plan.prompt_chunks:
            return HostInputs(layout=layout, buffer=buffer, index=k, has_adapter=False, samples=False)
        row, start, length, on_device, samples = _chunk_arrays(plan)
        self._sync_rows(row, plan.prompt_chunks, pages, f["reset"])
        offset = np.cumsum(length) - length  # first flat index of each chunk's tokens
        n = int(offset[-1] + length[-1])
        of_token = np.repeat(np.arange(len(row)), length)  # [n] chunk of each token
        pos = np.arange(n, dtype=np.int32) - offset[of_token] + start[of_token]
        slot = self._slot[row]
        f["positions"][:n] = pos
        f["slot_ids"][:n] = slot[of_token]
        f["write_page"][:n] = self._tables[row[of_token], pos // self.page_size]
        f["write_offset"][:n] = pos % self.page_size
        f["src"][offset[on_device]] = row[on_device]
        self._host_tokens(f["tokens"], plan, offset)
        f["q_start"][row], f["q_len"][row], f["kv_len"][row] = offset, length, start + length
        f["block_tables"][row] = self._tables[row]
        f["prompt_len"][row] = self._num_prompt[row]
        sampled = row[samples]
        for name in _ROW_SAMPLING:
            f[name][sampled] = self._sampling[name][sampled]
        for name in _PENALTIES:
            f[name][row] = self._sampling[name][row]
        penalties = bool(self._penalised[row].any())
        logprobs = bool(self._logprobs[sampled].any())
        # The index of the output token this step samples: the chunk ends where the request's known
        # tokens end, and outputs start after the prompt.
        f["counter"][sampled] = (start + length)[samples] - self._num_prompt[sampled]
        return HostInputs(
            layout=layout,
            buffer=buffer,
            index=k,
            has_adapter=bool(slot.any()),
            samples=bool((f["temperature"][sampled] > 0).any() or (f["counter"] < f["min_tokens"])[sampled].any())
            or penalties
            or logprobs,
            extended=penalties or logprobs,
        )

    @staticmethod
    def _host_tokens(tokens: np.ndarray, plan: StepPlan, offset: np.ndarray) -> None:
        """Writes the input ids the host holds: prompt chunks, and decode tokens whose input is not
        on the device (rare: a request whose previous output was read before the step)."""
        decode = plan.decode
        for i in np.flatnonzero(~decode.from_device).tolist():  # decode token i sits at index i
            position = int(decode.positions[i])
            tokens[i] = decode.requests[i].tokens(position, position + 1)[0]
        for c, o in zip(plan.prompt_chunks, offset[len(decode.requests) :].tolist()):
            if not c.from_device:
                tokens[o : o + c.length] = c.request.tokens(c.start, c.start + c.length)

    def _clear(self, f: dict[str, np.ndarray]) -> None:
        """Every row absent and greedy, every token padding (module doc of jaxlora.engine.runner)."""
        for name in ("block_tables", "q_start", "q_len", "kv_len", "temperature", "top_k", "seed", "counter", "min_p"):
            f[name].fill(0)
        for name in ("min_tokens", "prompt_len", "reset", "presence_penalty", "frequency_penalty"):
            f[name].fill(0)
        f["top_p"].fill(1.0)
        f["repetition_penalty"].fill(1.0)
        for name in ("tokens", "positions", "slot_ids", "write_offset"):
            f[name].fill(0)
        f["src"].fill(-1)
        f["write_page"].fill(self.num_pages)

    def _sync_rows(self, rows: np.ndarray, chunks: tuple[Chunk, ...], pages: PageTable, reset: np.ndarray) -> None:
        """Brings the host state of every row in the step (`rows`, one entry each) up to its request
        (class doc), and marks the rows it starts in `reset`; `chunks` are the step's chunks other
        than its decode tokens, which never start a row. The rows' page counts are compared at once:
        only rows with new pages loop."""
        for c in chunks:
            if c.start == c.request.num_cached:  # its first chunk on the row: after its cached prefix
                self._start_row(c.row, c.request)
                reset[c.row] = 1
        held, seen = pages.held(rows), self._pages_seen[rows]
        if (held < seen).any():
            i = int(np.argmax(held < seen))
            raise RuntimeError(
                f"row {rows[i]} holds {held[i]} pages but its block table has {seen[i]}: its pages "
                "changed without a chunk starting its row"
            )
        grown = held > seen
        for row, old, new in zip(rows[grown].tolist(), seen[grown].tolist(), held[grown].tolist()):
            self._tables[row, old:new] = pages.pages_of(row)[old:new]
        self._pages_seen[rows] = held

    def _start_row(self, row: int, req: Request) -> None:
        self._pages_seen[row] = 0
        self._slot[row], self._num_prompt[row] = req.slot, req.num_prompt
        s, p = self._sampling, req.sampling
        s["temperature"][row], s["top_k"][row], s["top_p"][row], s["seed"][row] = (
            p.temperature,
            p.top_k,
            p.top_p,
            req.seed,
        )
        s["min_p"][row], s["min_tokens"][row] = p.min_p, p.min_tokens
        s["repetition_penalty"][row], s["presence_penalty"][row] = p.repetition_penalty, p.presence_penalty
        s["frequency_penalty"][row] = p.frequency_penalty
        self._penalised[row] = p.has_penalties
        self._logprobs[row] = p.logprobs is not None


def _chunk_arrays(plan: StepPlan) -> tuple[np.ndarray, ...]:
    """Per chunk of the plan in packing order, decode tokens first: row, start, length (int32),
    from_device, samples (bool). The decode tokens come as arrays already (`DecodeRows`)."""
    decode, chunks = plan.decode, plan.prompt_chunks
    ones = np.ones(len(decode.requests), np.int32)
    if not chunks:
        return decode.rows, decode.positions, ones, decode.from_device, ones.astype(bool)
    meta = np.array([(c.row, c.start, c.length, c.from_device, c.samples) for c in chunks], np.int32)
    row, start, length = (np.concatenate([d, meta[:, i]]) for i, d in enumerate((decode.rows, decode.positions, ones)))
    on_device = np.concatenate([decode.from_device, meta[:, 3].astype(bool)])
    samples = np.concatenate([ones.astype(bool), meta[:, 4].astype(bool)])
    return row, start, length, on_device, samples


def _views(buffer: np.ndarray, layout: StepLayout) -> dict[str, np.ndarray]:
    """Field name -> numpy view of `buffer` (block_tables [S, P]), typed as the step reads it."""
    views = {name: buffer[span] for name, span in layout.spans.items()}
    views["block_tables"] = views["block_tables"].reshape(layout.rows, layout.pages_per_seq)
    for name in _FLOAT32:
        views[name] = views[name].view(np.float32)
    for name in _UINT32:
        views[name] = views[name].view(np.uint32)
    return views
