"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), translated onto
the chat generation path as the Responses API is (gateway/anthropic/messages_api.py)."""
