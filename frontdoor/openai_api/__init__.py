"""The OpenAI-compatible routes (`/v1/completions`, `/v1/chat/completions`, `/v1/models`):
requests translated to the model's contract and sent through the gateway's upstream."""
