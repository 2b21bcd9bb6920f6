"""One file per compaction method. Importing this package registers them all."""

from kvmemory.compaction.methods.attention_matching import AttentionMatching, AttentionMatchingConfig
from kvmemory.compaction.methods.counter_causal import CounterCausal, CounterCausalConfig
from kvmemory.compaction.methods.fitted import Fitted, FittedConfig
from kvmemory.compaction.methods.h2o import H2O, H2OConfig
from kvmemory.compaction.methods.key_norm import KeyNorm, KeyNormConfig
from kvmemory.compaction.methods.lines import Lines, LinesConfig
from kvmemory.compaction.methods.random_eviction import RandomEviction, RandomEvictionConfig
from kvmemory.compaction.methods.real import REAL, REALConfig
from kvmemory.compaction.methods.retrieval_lines import RetrievalLines, RetrievalLinesConfig
from kvmemory.compaction.methods.selective_context import SelectiveContext, SelectiveContextConfig
from kvmemory.compaction.methods.snapkv import SnapKV, SnapKVConfig
from kvmemory.compaction.methods.streaming_llm import StreamingLLM, StreamingLLMConfig
from kvmemory.compaction.methods.tam import TAM, TAMConfig
from kvmemory.compaction.methods.tova import TOVA, TOVAConfig

__all__ = [
    "AttentionMatching",
    "AttentionMatchingConfig",
    "CounterCausal",
    "CounterCausalConfig",
    "Fitted",
    "FittedConfig",
    "H2O",
    "H2OConfig",
    "KeyNorm",
    "KeyNormConfig",
    "Lines",
    "LinesConfig",
    "REAL",
    "REALConfig",
    "RandomEviction",
    "RandomEvictionConfig",
    "RetrievalLines",
    "RetrievalLinesConfig",
    "SelectiveContext",
    "SelectiveContextConfig",
    "SnapKV",
    "SnapKVConfig",
    "StreamingLLM",
    "StreamingLLMConfig",
    "TAM",
    "TAMConfig",
    "TOVA",
    "TOVAConfig",
]
