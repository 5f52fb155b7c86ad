"""OpenAI-compatible HTTP serving over the sampling loop: batching across requests, SSE streams, a live
denoising page. Needs the `serve` extra (fastapi, uvicorn); `import dllm.serving` imports neither."""
