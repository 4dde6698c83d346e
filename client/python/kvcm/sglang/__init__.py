"""SGLang integration: kvcm.sglang.hicache is a HiCache L3 storage backend over kvcm agents."""
