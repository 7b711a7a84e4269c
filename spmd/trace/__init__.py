"""The user's step as a program: made pure and flat (``signature``), turned into an op graph
(``graph``)."""
