"""Test doubles for kvcm's integrations (fake vLLM publisher and engine, manager fixtures)."""
