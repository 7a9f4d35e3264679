"""The stream tap (``proxy``), split by concern in the next commit."""
