"""Accounts and transfers."""


class InsufficientFunds(Exception):
    """A withdrawal larger than the balance."""


class Account:
    """A named balance."""

    def __init__(self, owner, balance=0):
        self.owner = owner
        self.balance = balance

    def deposit(self, amount):
        """Add a positive ``amount``."""
        if amount <= 0:
            raise ValueError("deposits must be positive")
        self.balance += amount

    def withdraw(self, amount):
        """Take ``amount`` out."""
        if amount > self.balance:
            raise InsufficientFunds(f"{self.owner} has {self.balance}")
        self.balance -= amount


def transfer(src, dst, amount):
    """Move ``amount`` from ``src`` to ``dst``."""
    src.withdraw(amount)
    dst.deposit(amount)
