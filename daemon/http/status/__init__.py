"""The status page at / and /ui, served from static/ beside it."""
