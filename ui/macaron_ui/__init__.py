"""The Textual chat app for macaron-local. A front end only: it calls the core's session API."""
