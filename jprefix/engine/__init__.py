"""The engine loop: its arguments, input processing (tokenize, validate, the chat
template), `LLMEngine.step` (schedule -> run -> postprocess, with one step in flight) and
output processing (stop strings, detokenization, RequestOutput)."""
