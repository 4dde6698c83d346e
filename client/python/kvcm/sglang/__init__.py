"""SGLang's side of kvcm: its KV-event wire format (kvcm.sglang.events) and block hashing
(kvcm.sglang.pagehash). The bridge is kvcm.engines' (`kvcm-bridge`, engine kind "sglang")."""
