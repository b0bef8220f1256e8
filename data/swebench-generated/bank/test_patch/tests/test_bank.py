import pytest

from bank import Account, InsufficientFunds, transfer


def test_transfer():
    a, b = Account("a", 100), Account("b")
    transfer(a, b, 30)
    assert (a.balance, b.balance) == (70, 30)


def test_overdraft():
    with pytest.raises(InsufficientFunds):
        Account("a", 5).withdraw(10)


def test_negative_withdrawal_rejected():
    a = Account("a", 50)
    with pytest.raises(ValueError):
        a.withdraw(-5)
    assert a.balance == 50


def test_failed_transfer_changes_nothing():
    a, b = Account("a", 50), Account("b", 0)
    with pytest.raises(ValueError):
        transfer(a, b, -10)
    assert (a.balance, b.balance) == (50, 0)
