"""The demo: a simulated SGLang prefill scheduler driving the whole package."""
