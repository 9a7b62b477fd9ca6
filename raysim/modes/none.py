"""``privacy.mode: none``: no DP; the server sees every report as it is."""

from raysim.modes.base import PrivacyMode


class NoPrivacy(PrivacyMode):
    name = "none"
    accounts_epsilon = False
