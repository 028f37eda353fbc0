"""Several models behind one endpoint: routing by name, admission by memory."""
