import pytest

from bank import Account, InsufficientFunds, transfer


def test_transfer():
    a, b = Account("a", 100), Account("b")
    transfer(a, b, 30)
    assert (a.balance, b.balance) == (70, 30)


def test_overdraft():
    with pytest.raises(InsufficientFunds):
        Account("a", 5).withdraw(10)
