"""Names and limits the client and the server share: one home for each."""

MODEL = "llm"  # the Triton model every request goes to
DEFAULT_URL = "localhost:8001"
DEFAULT_MAX_TOKENS = 64
MAX_MESSAGE_BYTES = 2**20  # the front door refuses larger gRPC messages (--max-message-bytes)
MAX_INPUT_BYTES = 16384  # the shipped model's text_input cap (max_input_bytes auto: 32 bytes a token of its context)
API_KEY_ENV = "BATCHSTRING_API_KEY"  # the key a server with API keys wants (never on a command line)
