"""Fault injection under load (`pdserve chaos`) and the leak check it ends with."""
