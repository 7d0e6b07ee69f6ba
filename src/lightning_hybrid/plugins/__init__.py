"""Lightning precision plugins of lightning-hybrid."""

__all__: list[str] = []
