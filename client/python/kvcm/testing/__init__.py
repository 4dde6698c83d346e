"""Test doubles for code that uses kvcm: a fake manager (fake_manager), a fake vLLM KV-event
publisher and prefix cache (fake_vllm), and a fake OpenAI-compatible engine for kvcm-router
(openai_engine). This repository's own rigs live in client/python/tests/rigs."""
