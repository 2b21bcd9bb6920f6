"""REAL head profiling: how each KV head behaves when the model retrieves a fact among distractors.

Needle tasks are generated: a fact ("The access code of server <name> is <number>.") and distractor facts
about other servers are planted at different depths in real haystack text (Python standard-library
docstrings, always on disk); the model answers a question greedily. For every generated token and head,
the top-k attended positions of its query give
  W_R = top-k mass on the answer source, W_D = top-k mass elsewhere, W_B = source mass outside the top-k;
RAsc = W_R/(W_R+W_D), LCsc = W_R/(W_R+W_B), INFsc = their harmonic mean; HeadKV-R2 = mass of the
top-|source| positions that fall in the source. Averaged over tokens and correctly answered cases,
query heads averaged into their KV head. Profiles are saved per model as JSON.

The REAL methods read a profile through their span's ``ModelView.head_profile`` (``compaction/head_budgets.py``
``head_scores``): profiling runs the model, which is the runtime's.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmemory.errors import KVMemoryError
from kvmemory.notices import one_time_work, progress
from kvmemory.runtime.named_models import CACHE_DIR

PROFILE_DIR = CACHE_DIR / "head_profiles"
SHIPPED_DIR = Path(__file__).parent / "head_profiles"  # made with this module for the named models
HAYSTACK_MODULES = (
    "json",
    "re",
    "os",
    "pathlib",
    "argparse",
    "subprocess",
    "logging",
    "collections",
    "typing",
    "asyncio",
)
NAMES = ("atlas", "boreal", "cobalt", "delta", "ember", "falcon", "granite", "harbor", "indigo", "juniper")


@dataclass
class HeadProfile:
    model: str
    rasc: list[list[float]]
    lcsc: list[list[float]]
    infsc: list[list[float]]
    r2: list[list[float]]
    cases: int
    correct: int

    def scores(self, which: str = "infsc") -> torch.Tensor:
        return torch.tensor(getattr(self, which))

    def save(self, path: str | Path | None = None) -> Path:
        path = Path(path) if path else default_profile_path(self.model)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.__dict__, indent=1))
        return path

    @classmethod
    def uniform(cls, model: str, layers: int, heads: int) -> HeadProfile:
        """Every head scored alike (REAL's budgets then give every head the same count)."""
        ones = [[1.0] * heads for _ in range(layers)]
        return cls(model, ones, ones, ones, ones, cases=0, correct=0)

    @classmethod
    def load(cls, path: str | Path | None) -> HeadProfile:
        if path is None:
            raise FileNotFoundError(
                "no head profile given: run kvmemory.runtime.head_profiling.profile_heads(engine).save()"
            )
        return cls(**json.loads(Path(path).read_text()))


def default_profile_path(model_name: str) -> Path:
    return PROFILE_DIR / f"{model_name.replace('/', '__')}.json"


def profile_for(engine, path: str | Path | None = None) -> HeadProfile:
    """The head profile to use for ``engine``: the given file, or a shipped or cached one. Profiling runs the
    model for a minute, so it happens when a model is prepared (``prepare_profile``), never inside a turn: a
    model without a profile has every head scored alike, with a warning naming the command that profiles it."""
    if path is not None:
        return HeadProfile.load(path)
    profile = stored_profile(engine)
    if profile is None:
        warnings.warn(
            f"no head profile for {engine.name}: every head is scored alike until `kvmemory models profile "
            f"MODEL` profiles it (about a minute, once)",
            stacklevel=2,
        )
        profile = HeadProfile.uniform(engine.name, engine.num_layers, engine.num_kv_heads)
    return profile


def stored_profile(engine) -> HeadProfile | None:
    """The profile shipped for ``engine``'s model or cached for it, if one fits its layers and KV heads."""
    name = engine.name.replace("/", "__")
    for candidate in (SHIPPED_DIR / f"{name}.json", default_profile_path(engine.name)):
        if candidate.is_file():
            profile = HeadProfile.load(candidate)
            if len(profile.infsc) == engine.num_layers and len(profile.infsc[0]) == engine.num_kv_heads:
                return profile
    return None


def prepare_profile(engine) -> tuple[HeadProfile, Path | None]:
    """Model preparation: the stored profile, or a new one made now and cached (with the file it was saved
    to). The needle tasks are text, so an engine without a tokenizer is refused."""
    profile = stored_profile(engine)
    if profile is not None:
        return profile, None
    if engine.tokenizer is None:
        raise KVMemoryError(f"{engine.name} has no tokenizer: its heads cannot be profiled on needle tasks")
    with one_time_work(f"profiling the KV heads of {engine.name} on needle tasks", "a minute"):
        profile = profile_heads(engine, model_name=engine.name)
    return profile, profile.save()


def haystack_text() -> str:
    parts = []
    for name in HAYSTACK_MODULES:
        doc = inspect.getdoc(importlib.import_module(name)) or ""
        parts.append(doc)
    return "\n\n".join(parts)


def needle_case(rng: random.Random, haystack_tokens: list[int], tokenizer, n_distractors: int = 3, depth: float = 0.5):
    """(prompt token ids, (start, end) of the answer source in them, answer string)."""
    names = rng.sample(NAMES, n_distractors + 1)
    values = [str(rng.randint(1000, 9999)) for _ in names]
    facts = [f" The access code of server {n} is {v}. " for n, v in zip(names, values)]
    depths = [depth] + [rng.random() for _ in range(n_distractors)]
    pieces, cursor, source = [], 0, None
    for d, fact in sorted(zip(depths, facts)):
        cut = int(d * len(haystack_tokens))
        pieces.append(haystack_tokens[cursor:cut])
        cursor = cut
        fact_ids = tokenizer.encode(fact, add_special_tokens=False)
        if fact == facts[0]:
            start = sum(len(p) for p in pieces)
            source = (start, start + len(fact_ids))
        pieces.append(fact_ids)
    pieces.append(haystack_tokens[cursor:])
    question = tokenizer.encode(
        f"\nQuestion: what is the access code of server {names[0]}?\nAnswer: the access code is",
        add_special_tokens=False,
    )
    ids = [t for p in pieces for t in p] + question
    return ids, source, values[0]


def head_metrics(attn: torch.Tensor, source: tuple[int, int], k: int = 10) -> dict[str, torch.Tensor]:
    """attn (heads, S) for one generated token → per-head W_R, W_D, W_B and R2 mass."""
    in_source = torch.zeros(attn.shape[-1], dtype=torch.bool)
    in_source[source[0] : source[1]] = True
    top = torch.topk(attn, min(k, attn.shape[-1]), dim=-1).indices
    top_mask = torch.zeros_like(attn, dtype=torch.bool).scatter_(1, top, True)
    w_r = (attn * (top_mask & in_source)).sum(-1)
    w_d = (attn * (top_mask & ~in_source)).sum(-1)
    w_b = (attn * (~top_mask & in_source)).sum(-1)
    span = source[1] - source[0]
    top_span = torch.topk(attn, min(span, attn.shape[-1]), dim=-1).indices
    r2 = (attn.gather(1, top_span) * in_source[top_span]).sum(-1)
    return {"w_r": w_r, "w_d": w_d, "w_b": w_b, "r2": r2}


@torch.no_grad()
def profile_heads(
    engine, cases: int = 8, answer_tokens: int = 6, haystack_tokens: int = 600, seed: int = 0, model_name: str = "model"
) -> HeadProfile:
    """Profile every KV head of ``engine``'s model on generated needle tasks."""
    tok = engine.tokenizer
    rng = random.Random(seed)
    hay = tok.encode(haystack_text(), add_special_tokens=False)[:haystack_tokens]
    L, H = engine.num_layers, engine.num_kv_heads
    G = engine.config.num_attention_heads // H
    sums = {m: torch.zeros(L, H) for m in ("rasc", "lcsc", "infsc", "r2")}
    sums_all = {m: torch.zeros(L, H) for m in sums}
    correct, counted, counted_all = 0, 0, 0
    for case in progress(range(cases), cases, "needle tasks"):
        ids, source, answer = needle_case(rng, hay, tok, depth=(case + 0.5) / cases)
        session = engine.session()
        recorder = session.record_queries(window=0)
        session.append_tokens(ids)
        recorder.start_capture()
        result = session.generate(max_new_tokens=answer_tokens)
        captured = recorder.stop_capture()
        ok = answer in result.text
        case_scores = {m: torch.zeros(L, H) for m in sums}
        steps = captured[0].shape[1] // G
        for layer_idx in range(L):
            layer = session.cache.layers[layer_idx]
            keys = layer.keys[0, :, : layer.length].float()
            q = captured[layer_idx].view(H, steps, G, -1).float()
            for step in range(steps):
                visible = len(ids) + step + 1
                logits = torch.einsum("hgd,hsd->hgs", q[:, step], keys[:, :visible]) * engine.head_dim**-0.5
                attn = torch.softmax(logits, -1).reshape(H * G, visible)
                met = head_metrics(attn, source)
                w_r, w_d, w_b = met["w_r"], met["w_d"], met["w_b"]
                rasc = w_r / (w_r + w_d).clamp_min(1e-12)
                lcsc = w_r / (w_r + w_b).clamp_min(1e-12)
                inf = 2 * rasc * lcsc / (rasc + lcsc).clamp_min(1e-12)
                for name, value in (("rasc", rasc), ("lcsc", lcsc), ("infsc", inf), ("r2", met["r2"])):
                    case_scores[name][layer_idx] += value.view(H, G).mean(1) / steps
        session.close()
        for m in sums:
            sums_all[m] += case_scores[m]
            if ok:
                sums[m] += case_scores[m]
        counted_all += 1
        if ok:
            correct += 1
            counted += 1
    chosen, n = (sums, counted) if counted else (sums_all, counted_all)  # no correct answer: use every case
    return HeadProfile(model_name, *[(chosen[m] / n).tolist() for m in ("rasc", "lcsc", "infsc", "r2")], cases, correct)
