"""Lightning callbacks of lightning-hybrid."""

__all__: list[str] = []
