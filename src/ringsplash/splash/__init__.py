"""Splash (sparse flash) attention: Pallas TPU kernels, a jnp backend and the custom VJP."""

from ringsplash.splash.attention import splash_attention, splash_backward, splash_forward
from ringsplash.splash.config import SplashConfig

__all__ = ["SplashConfig", "splash_attention", "splash_backward", "splash_forward"]
