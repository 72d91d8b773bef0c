"""Screens of the chat app."""
