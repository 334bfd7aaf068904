"""The command lines: ``python -m workers`` (engine) and ``fluxrl`` (fluxrl, the
platform client). The only code that reads argv and prints answers to its user.

Top layer: may import anything in workers; nothing imports it.
"""
