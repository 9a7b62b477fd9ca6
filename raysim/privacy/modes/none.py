"""``privacy.mode: none``: no DP; the server sees every report as it is."""

from raysim.privacy.modes.base import PrivacyMode


class NoPrivacy(PrivacyMode):
    name = "none"
    accounts_epsilon = False
