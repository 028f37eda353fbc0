"""One model's lifecycle."""
