"""The names of the dtypes a KV cache may be stored in (``Engine(kv_dtype=...)``), without importing torch: the
command line offers them before any model code loads."""

KV_DTYPE_NAMES = ("float32", "float16", "bfloat16", "int8")
