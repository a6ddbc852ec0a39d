"""The oracle: the original export run the way its exporter meant it, against the compiled pipeline.

verify's per-graph comparison feeds the original and the compiled graphs the same static,
padded inputs, so a change of meaning made by the static cache, the additive mask or the
padding (what compile exists to do) is invisible to it. Here the original runs as its exporter
meant it, and the compiled graphs run through the reference runtime (`Generator`):

    original   with cache inputs: step 0 feeds the prompt [1,P], its own mask form (2-D ones
               [1,P], or none), positions 0..P-1 and an empty cache [1,Hkv,0,D]; every next step
               feeds the chosen token, ones [1,L+1], position L and the presents it returned
               (its cache grows by one per step). Without cache inputs: the whole sequence each step.
               A `logits_to_keep` index input (transformers' model exported itself) is fed -1:
               the original returns the last position's logits only, compared with that row.
    compiled   `Generator`: prefill T tokens per call (a short tail padded), decode one per call.

Per prompt (seeded, shorter and longer than T): the logits of every real position (the prompt,
then each new token while both sides have chosen the same tokens) are compared, cosine and max
abs per step, and the greedy tokens must be equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from mtkc.contract import exporters, io

NEW_TOKENS = 8  # greedy tokens per prompt: seconds on tiny models
KEEP_INPUTS = ("logits_to_keep",)  # an integer scalar picking the position whose logits are returned
LAST = -1  # what the oracle feeds it: the last position, the one greedy decoding reads


def picks_positions(name: str, shape) -> bool:
    """Whether an export input is a `logits_to_keep` index (scalar), fed `LAST`."""
    return name in KEEP_INPUTS and len(shape) == 0


@dataclass
class Generation:
    """One prompt through both sides: per-step figures over the comparable steps, and the tokens."""

    prompt_len: int
    expected: list[int]  # the original's greedy tokens
    actual: list[int]  # the compiled pipeline's
    steps: int  # logits rows compared (prompt positions + decode steps)
    max_abs: float
    cosine: float  # the worst step's
    worst_step: int  # the row with the lowest cosine (0..P-1: prompt positions)
    logits_ok: bool
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.logits_ok and self.expected == self.actual and self.steps > 0

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}


@dataclass
class OriginalRun:
    """What the original did with one prompt: its greedy tokens and logits rows [P + n - 1, V]."""

    prompt: list[int]
    tokens: list[int]
    logits: np.ndarray
    first_row: int = 0  # the position of logits[0] (P - 1 when the export returns the last row only)


@dataclass
class Original:
    """An ONNX export fed as its exporter meant: roles of its inputs/outputs from the contract."""

    session: object
    ids: str
    mask: str | None = None
    positions: str | None = None
    pasts: dict[tuple[str, int], str] = field(default_factory=dict)  # (kind, layer) -> input name
    presents: dict[tuple[str, int], str] = field(default_factory=dict)  # (kind, layer) -> output name
    empty: dict[str, list[int]] = field(default_factory=dict)  # cache input -> its empty shape
    logits: str = io.LOGITS
    types: dict[str, np.dtype] = field(default_factory=dict)
    keep: str | None = None  # a logits_to_keep input (fed LAST)

    @classmethod
    def of(cls, session, cache_shapes: dict[str, list[int]]) -> Original | str:
        """Roles of `session`'s I/O, or why it cannot be run as an exporter would (a note).
        `cache_shapes`: the compiled past_* shapes [1,Hkv,C,D] (head dims the export leaves symbolic)."""
        inputs, outputs = session.get_inputs(), session.get_outputs()
        types = {x.name: io.ort_dtype(x.type) for x in inputs}
        names = [x.name for x in inputs]
        pasts = exporters.cache_entries(names, [len(x.shape) for x in inputs], "past")
        outs = [o.name for o in outputs]
        logits = io.LOGITS if io.LOGITS in outs else outs[0]
        presents = exporters.cache_entries([o for o in outs if o != logits],
                                           [len(o.shape) for o in outputs if o.name != logits], "present")
        if len(presents) != len(pasts):
            return f"{len(pasts)} cache inputs but {len(presents)} cache outputs"
        known = {n for n, _, _ in pasts}
        roles: dict[str, str | None] = {"ids": None, "mask": None, "positions": None}
        keep = None
        for x in inputs:
            if x.name in known:
                continue
            if picks_positions(x.name, x.shape) and types[x.name] is not None and np.issubdtype(types[x.name], np.integer):
                keep = x.name
                continue
            role = {io.INPUT_IDS: "ids", io.ATTENTION_MASK: "mask", io.POSITION_IDS: "positions"}.get(x.name)
            if role is None or len(x.shape) != 2 or types[x.name] is None or not np.issubdtype(types[x.name], np.integer):
                return f"input '{x.name}' {x.shape} has no role the oracle can feed"
            roles[role] = x.name
        if roles["ids"] is None:
            return "no input_ids input"
        empty = {}
        by_name = {x.name: x for x in inputs}
        for name, kind, layer in pasts:
            shape = _static(by_name[name].shape)
            hint = cache_shapes.get(io.past(kind, layer))
            if len(shape) != 4 or (None in (shape[1], shape[3]) and hint is None):
                return f"cache input '{name}' {by_name[name].shape}: head count or size unknown"
            empty[name] = [1, shape[1] if shape[1] is not None else hint[1], 0,
                           shape[3] if shape[3] is not None else hint[3]]
        return cls(session, roles["ids"], roles["mask"], roles["positions"],
                   {(k, i): n for n, k, i in pasts}, {(k, i): n for n, k, i in presents}, empty, logits, types, keep)

    def run(self, prompt: list[int], new_tokens: int) -> OriginalRun:
        """Greedy tokens after `prompt` and the logits of every position fed (prompt, then each new token)."""
        rows: list[np.ndarray] = []
        tokens = self.generate(prompt, new_tokens, rows.append)
        return OriginalRun(list(prompt), tokens, np.concatenate(rows), len(prompt) - len(rows[0]))

    def generate(self, prompt: list[int], new_tokens: int, observe: Callable[[np.ndarray], None]) -> list[int]:
        """Greedy tokens after `prompt`; `observe(logits [k, V])` per call, k = the tokens it fed."""
        sequence = list(prompt)
        cache = {name: np.zeros(shape, self.types[name] or np.float32) for name, shape in self.empty.items()}
        cached = 0
        out: list[int] = []
        while len(out) < new_tokens:
            fed = sequence[cached:] if self.pasts else sequence
            start = cached if self.pasts else 0
            feeds = {self.ids: np.array([fed], self.types[self.ids])}
            if self.mask:
                feeds[self.mask] = np.ones((1, start + len(fed)), self.types[self.mask])
            if self.positions:
                feeds[self.positions] = np.arange(start, start + len(fed), dtype=self.types[self.positions])[None]
            if self.keep:
                feeds[self.keep] = np.array(LAST, self.types[self.keep])
            feeds.update(cache)
            wanted = [self.logits] + list(self.presents.values())
            result = dict(zip(wanted, self.session.run(wanted, feeds)))
            logits = result[self.logits][0]
            logits = logits[None] if logits.ndim == 1 else logits  # [V]: the kept position's row
            observe(logits if not out else logits[-1:])
            if self.pasts:
                cache = {self.pasts[key]: result[name] for key, name in self.presents.items()}
                cached = len(sequence)
            out.append(int(np.argmax(logits[-1])))
            sequence.append(out[-1])
        return out


def prompts(seq_len: int, cache_len: int, vocab: int, new_tokens: int, seed: int = 0) -> list[list[int]]:
    """Seeded prompts: one shorter than T, one longer (when it and the new tokens fit the cache)."""
    rng = np.random.default_rng(seed)
    lengths = [max(1, seq_len // 2)]
    long = seq_len + max(1, seq_len // 2)
    if long + new_tokens + seq_len <= cache_len:  # room for the padded last call (sliding layout too)
        lengths.append(long)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def compare_generation(generator, run: OriginalRun, compare, atol: float, rtol: float,
                       min_cosine: float) -> Generation:
    """Run the original's prompt through the compiled pipeline and compare (see the module docstring)."""
    got_rows: list[np.ndarray] = []
    expected = run.tokens
    actual = generator.generate(run.prompt, len(expected), got_rows.append)
    if generator.stop_reason:  # the static cache is full: compare the tokens it holds
        expected = expected[:len(actual)]
    agree = next((j for j, (a, b) in enumerate(zip(expected, actual)) if a != b), min(len(expected), len(actual)))
    rows = len(run.prompt) + min(agree, len(actual) - 1, len(expected) - 1)  # decode row j fed token j-1
    want = run.logits[:rows - run.first_row]
    got = np.concatenate(got_rows)[run.first_row:rows]
    figures = []  # (max abs, cosine, ok) per step
    for step in range(min(len(want), len(got))):
        max_abs, _, cosine, close = compare(got[step], want[step], atol, rtol)
        figures.append((max_abs, cosine, close and cosine >= min_cosine))
    cosines = [f[1] for f in figures]
    return Generation(len(run.prompt), expected, actual, len(figures), max((f[0] for f in figures), default=0.0),
                      min(cosines, default=0.0), int(np.argmin(cosines)) if cosines else 0,
                      all(f[2] for f in figures), generator.stop_reason or "")


def _static(shape) -> list[int | None]:
    """Dims as ints where the export gives them (ints, or digit strings as transformers' exporter writes)."""
    return [d if isinstance(d, int) else int(d) if isinstance(d, str) and d.isdigit() else None for d in shape]
