from bank.core import Account, InsufficientFunds, transfer
