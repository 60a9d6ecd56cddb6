"""The engine loop and a request's lifecycle: `LLMEngine`, the offline `LLM`, the clients that run
the loop on a thread or in a process of its own, detokenizing and prompt logprobs."""
