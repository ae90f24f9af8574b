"""llm-admission-gateway: an admission-control gateway for OpenAI-compatible LLM replicas."""

__version__ = "0.1.0"
