"""The part of vLLM's OpenAI-compatible API that trainers use to ask a teacher for
log-probabilities (TRL's `VLLMClient.get_sequence_logprobs`, ms-swift's GKD, ...), served by
the same engine as the gRPC sessions: `GET /v1/models`, `GET /health`, `POST /v1/completions`.

- `outputs.py`: the kind the requests ask the engine for (prompt top-k log-probabilities with
  each prompt token's own log-probability and rank, the last position's distribution).
- `jobs.py`: in-process sessions, one per job and request shape, whose outputs come back to
  the HTTP handler instead of over a process group; fair share, held-output limits and the
  cache apply to them as to any session.
- `protocol.py`: the requests, read and checked with vLLM's field names and error shapes, and
  the responses, written with its JSON shapes and conventions.
- `writer.py`: the child process that writes the JSON of prompt log-probabilities, off the
  engine's GIL and at a lower priority.
- `routes.py`: the FastAPI routes.
"""
