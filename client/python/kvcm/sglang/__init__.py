"""SGLang's side of kvcm: its KV-event wire format (kvcm.sglang.events) and block hashing
(kvcm.sglang.pagehash), for the bridge (kvcm.engines' `kvcm-bridge`, engine kind "sglang");
and kvcm.sglang.hicache, a HiCache L3 storage backend over kvcm agents."""
