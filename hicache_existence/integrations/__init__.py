"""Integrations with serving frameworks; today SGLang (``integrations.sglang``)."""
