"""Registration only. The target is a lazy "module:attribute" string, so `roll list-plugins`
shows the environment without importing it."""

from roll_core import hookimpl


@hookimpl
def roll_register_envs(register):
    register("guess_number", "roll_guess_number.env:GuessNumber",
             description="find a hidden number in 1..high from 'higher' / 'lower' hints")
