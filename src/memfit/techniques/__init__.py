"""One technique per file: a small class with a frozen ``Config`` and ``apply``."""
