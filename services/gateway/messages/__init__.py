"""Anthropic's Messages API: its requests, replies and events, and routes."""
